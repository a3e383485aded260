"""Readers as the frameworks take them: torch tensors (`torch`, with DataLoader workers in
`torch_workers`), a ``tf.data.Dataset`` (`tf`) and JAX arrays (`jax`), all collated the same way
(`collate`). Public as ``shardkit.torch``, ``shardkit.tf`` and ``shardkit.jax``; each imports its
framework, so nothing here is imported with the package.
"""

__all__: list[str] = []
