"""What watching a job's processes takes, shared by the supervisor (`shardkit.cluster.supervisor`) and a
torchrun node (`shardkit.cluster.engines.torchrun`): the heartbeats received and the samples they count
(`heartbeats`), the roles' output (`output`), the progress line and TensorBoard scalars (`progress`), the
attempts and summary (`report`), the checks before anything starts (`preflight`), the signals that stop
a job (`stop_signals`) and the watcher that stops the roles when the trainer is killed (`watcher`).

Its modules are imported by name; nothing here is imported with the package.
"""

__all__: list[str] = []
