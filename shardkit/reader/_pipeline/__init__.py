"""A reader's pipeline, inside `shardkit.reader.Reader`: row groups fetched and decoded (`source`), the
rows of a window put together in the plan's order (`assemble`) and cut into batches (`batching`); a
mixture's rows placed straight in its batches' memory (`placing`).
"""

__all__: list[str] = []
