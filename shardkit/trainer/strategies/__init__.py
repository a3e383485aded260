"""Distribution strategies a training script uses beyond plain allreduce: TensorFlow's, made from the
job (`tf`: ``MultiWorkerMirroredStrategy``, the parameter-server coordinator and its scheduler), and a
torch parameter server over ``torch.distributed.rpc`` (`torch_ps`). Each imports its framework, so
nothing here is imported with the package.
"""

__all__: list[str] = []
