"""vit_jax's input pipelines (tf.data / tfds -> numpy batches), the only place that reads data
with TensorFlow. Importing it hides the accelerators from TensorFlow and registers the offline
``fashion_mnist_local`` builder."""

from vit_jax import platform as _platform

_platform.hide_accelerators_from_tensorflow()

# pylint: disable=g-import-not-at-top,wrong-import-position
from vit_jax.data import fashion_mnist_local  # Registers the builder.
from vit_jax.data.pipeline import (DatasetInfo, EvalDataset, TrainIterator, create_eval_dataset,
                                   create_train_iterator, get_info, local_batch_size,
                                   train_read_mode)
from vit_jax.data.bad_images import BadImageError, find_undecodable

__all__ = [
    'BadImageError', 'DatasetInfo', 'EvalDataset', 'TrainIterator', 'create_eval_dataset',
    'create_train_iterator', 'fashion_mnist_local', 'find_undecodable',
    'get_info', 'local_batch_size', 'train_read_mode',
]
