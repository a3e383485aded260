"""Job config -> roles -> processes on an engine: `run_job` is what ``shardkit train`` calls."""

from __future__ import annotations

from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from shardkit.cluster.monitor.report import JobResult
    from shardkit.job.config import JobConfig
    from shardkit.trainer.rerun import Rerun

__all__ = ["run_job"]


def run_job(config: JobConfig, *, node_rank: int | None = None, echo: bool = True,
            console: TextIO | None = None, rerun: Rerun = "refuse") -> JobResult:
    """Run a job to its end: start every process, watch them, restart from checkpoints, summarize.

    Example:
        >>> from shardkit.job.config import load_config
        >>> result = run_job(load_config("examples/digits.yaml"))
        >>> result.steps, result.restarts, result.samples_per_s

    Running a job again (``rerun``; `shardkit.trainer.rerun` has the model): where the logdir's
    checkpoint folder holds a run that completed, ``"refuse"`` (the default, as ``shardkit train``)
    raises `CompletedRunError` before anything starts, naming the run, when it completed, the overrides
    that would change what it trains, and the choices; ``"resume"`` continues it from its last
    checkpoint (``shardkit train --resume``); ``"fresh"`` moves the earlier run's checkpoints and logs to
    ``<logdir>/previous/<time>/`` and starts from step 0 (``--fresh``; also for an unfinished run). An
    interrupted or failed run resumes by default. A torchrun job: node 0 decides.

    Policy (the job config's ``fault_tolerance``):
    - Before anything starts: the secrets are read; a ``data.url`` on this machine's filesystem is
      opened as a dataset when the roles run here (local engine, a local Ray instance, a local Spark
      master); the logdir is locked for this run (``<logdir>/.lock``: a second run with the same
      logdir is refused); ``<logdir>/job.json`` (the config without secret values) is written, and
      ``<logdir>/logs`` and ``<logdir>/tensorboard`` from an earlier run are cleared. Checkpoints are
      kept: a job started again resumes from its newest one (a completed one: see ``rerun`` above).
    - Each attempt starts every process with fresh ports (`shardkit.cluster._spec.build_spec`); output
      goes to ``<logdir>/logs/attempt-<k>/<role>-<i>.log`` and, with ``echo``, to the console prefixed
      with ``[role-i]``. A progress line (step, samples/s, metrics, restarts) shows every few seconds.
    - An attempt fails when a process exits non-zero, or is silent longer than ``heartbeat_timeout``
      after its first heartbeat showing life (a step, ``alive``; ``startup_timeout`` before it, and
      after it reported ``done``). Then every process is stopped (SIGTERM, SIGKILL after the engine's
      grace period, whole process groups) and, up to ``max_restarts`` times, the job starts again; the
      script resumes from the newest complete checkpoint with ``ctx.checkpoint.restore``.
    - The job succeeds when every driver role (`shardkit.cluster.supervisor.driver_roles`) exited 0;
      the other roles (parameter servers, ...) are then stopped. A process that reported ``done`` and
      then aborted (SIGABRT, seen with gloo at exit) counts as finished, with a note in the summary.
    - At the end ``<logdir>/summary.json`` is written and a summary printed; TensorBoard scalars
      (metrics, samples/s, restarts) are in ``<logdir>/tensorboard``. Secret values (4 characters or
      more) are masked as ``***`` in the roles' logs and in everything the supervisor prints or writes
      (`shardkit.job.masking`).
    - Ctrl-C, SIGTERM or SIGHUP stops every process (no orphans), writes the summary and raises
      KeyboardInterrupt (its ``signum`` attribute says which; ``shardkit train`` exits 128 + it). If the
      trainer is SIGKILLed, the roles die with it (parent-death signal) and a watcher process stops
      what they started (`shardkit.cluster.monitor.watcher`).
    - Showing progress never stops a job: a TensorBoard or progress error is shown once as a warning.
    - The engine the supervisor made is closed at the end (a local Ray instance or a SparkSession it
      started is shut down).

    With ``engine: torchrun`` this runs one node of the job instead (torch's elastic agent starts and
    restarts the workers; see `shardkit.cluster.engines.torchrun.run_node`): ``node_rank`` is this
    node's rank (default ``engine.node_rank``, else 0). Other engines ignore ``node_rank``.

    Raises:
        JobError: restarts exhausted (the message holds every failure with the end of its log; the
            `JobResult` is its ``result`` attribute), or the processes could not start.
        ConfigError: an unknown engine or engine option, a secret that cannot be read, a local
            ``data.url`` with no dataset, or a logdir in use by another run or that cannot be written.
        CompletedRunError: the logdir holds a completed run and ``rerun`` is ``"refuse"``.
    """
    if config.engine.name == "torchrun":  # one node's elastic agent; torch's agent does the restarts
        from shardkit.cluster.engines.torchrun import run_node

        return run_node(config, node_rank=node_rank, echo=echo, console=console, rerun=rerun)
    from shardkit.cluster.supervisor import Supervisor

    return Supervisor(config, echo=echo, console=console, rerun=rerun).run()
