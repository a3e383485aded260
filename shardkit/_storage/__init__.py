"""Storage shared below the format: locations on any fsspec filesystem (`location`), the errors of
reaching them turned into shardkit's (`access`), and advisory file locks (`lockfile`). Private: the
dataset layer and the trainer's checkpoints use it; users meet it through their URLs and
``storage_options``.
"""

__all__: list[str] = []
