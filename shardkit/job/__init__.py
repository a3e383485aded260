"""The job: what ``shardkit train`` and a training process agree on. The job config (`JobConfig`, read
by `load_config` from YAML), the wire protocol between the processes and whoever started them
(`protocol`: environment variables, heartbeats), the process layout (`layout`: each process's role,
rank and data shard) and the masking of secret values (`masking`). The trainer reads it; the cluster
writes it; neither knows the other.

Example:
    >>> from shardkit.job import load_config
    >>> config = load_config("examples/digits.yaml", overrides=["params.lr=0.1"])
"""

from shardkit.job.config import JobConfig, load_config

__all__ = ["JobConfig", "load_config"]
