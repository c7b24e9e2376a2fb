"""vit_jax input pipelines (tf.data / tfds -> numpy batches): the only place that reads data
with TensorFlow.

Importing it hides the accelerators from TensorFlow (they belong to JAX) and registers the
offline ``fashion_mnist_local`` builder. API: ``get_info``, ``create_train_iterator``,
``create_eval_dataset`` (:mod:`.pipeline`), ``BadImageError``, ``find_undecodable``.
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
