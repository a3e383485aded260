"""A reader's pipeline, inside `shardkit.reader.Reader`: row groups fetched and decoded (`source`), the
rows of a window put together in the plan's order (`assemble`) and cut into batches (`batching`).
"""

__all__: list[str] = []
