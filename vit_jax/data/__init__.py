"""vit_jax input pipelines (tf.data / tfds -> numpy batches).

This package is the only place in vit_jax that imports TensorFlow. At import
it hides all GPUs/TPUs from TensorFlow so that tf.data never grabs an
accelerator (they belong to JAX), and it registers the offline
`fashion_mnist_local` tfds builder.

API:
  get_default_config() -> ml_collections.ConfigDict   # config.data defaults
  get_info(config.data) -> DatasetInfo
  create_train_iterator(config.data, global_batch_size, seed, start_step=0)
  create_eval_dataset(config.data, global_batch_size)
  BadImageError  # raised by iterating them for undecodable images
  find_undecodable(paths) -> list of the paths that cannot be decoded
"""

import tensorflow as tf

for _kind in ('GPU', 'TPU'):
  try:
    tf.config.set_visible_devices([], _kind)
  except (RuntimeError, ValueError):  # Already initialized / unknown kind.
    pass
del _kind

# pylint: disable=g-import-not-at-top,wrong-import-position
from vit_jax.data import fashion_mnist_local  # Registers the builder.
from vit_jax.data.config import AUGMENTATIONS
from vit_jax.data.config import BAD_IMAGES
from vit_jax.data.config import get_default_config
from vit_jax.data.config import NORMALIZATIONS
from vit_jax.data.pipeline import create_eval_dataset
from vit_jax.data.pipeline import create_train_iterator
from vit_jax.data.pipeline import DatasetInfo
from vit_jax.data.pipeline import EvalDataset
from vit_jax.data.pipeline import get_info
from vit_jax.data.pipeline import local_batch_size
from vit_jax.data.pipeline import TrainIterator
from vit_jax.data.sources import BadImageError
from vit_jax.data.sources import find_undecodable

__all__ = [
    'AUGMENTATIONS', 'BAD_IMAGES', 'NORMALIZATIONS', 'BadImageError',
    'DatasetInfo', 'EvalDataset', 'TrainIterator', 'create_eval_dataset',
    'create_train_iterator', 'fashion_mnist_local', 'find_undecodable',
    'get_default_config', 'get_info', 'local_batch_size',
]
