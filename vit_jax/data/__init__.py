"""vit_jax input pipelines (tf.data / tfds -> numpy batches).

This package is the only place in vit_jax that reads data with TensorFlow. At import it hides
all GPUs/TPUs from TensorFlow (`vit_jax.platform.hide_accelerators_from_tensorflow`) so that
tf.data never grabs an accelerator (they belong to JAX), and it registers the offline
`fashion_mnist_local` tfds builder. The defaults of `config.data` are
`vit_jax.config.defaults.data_config`.

API:
  get_info(config.data) -> DatasetInfo
  create_train_iterator(config.data, global_batch_size, seed, start_step=0)
  create_eval_dataset(config.data, global_batch_size)
  BadImageError  # raised by iterating them for undecodable images
  find_undecodable(paths) -> list of the paths that cannot be decoded
"""

from vit_jax import platform as _platform

_platform.hide_accelerators_from_tensorflow()

# pylint: disable=g-import-not-at-top,wrong-import-position
from vit_jax.data import fashion_mnist_local  # Registers the builder.
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
    'BadImageError', 'DatasetInfo', 'EvalDataset', 'TrainIterator', 'create_eval_dataset',
    'create_train_iterator', 'fashion_mnist_local', 'find_undecodable',
    'get_info', 'local_batch_size',
]
