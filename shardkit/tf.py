"""TensorFlow adapters, public as ``shardkit.tf`` (TensorFlow is imported only when this module is).

Example:
    >>> import shardkit.tf
    >>> model.fit(shardkit.tf.make_dataset(url, batch_size=64, label="label"), epochs=3)
"""

from shardkit.reader.adapters.collate import Collate
from shardkit.reader.adapters.tf import dataset_fn, distribute_dataset, element_spec, make_dataset

__all__ = ["Collate", "dataset_fn", "distribute_dataset", "element_spec", "make_dataset"]
