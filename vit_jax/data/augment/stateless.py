"""Stateless randomness shared by the augmentations: every random number is a function of an
int64 [2] seed (`tf.random.stateless_*`), so a resumed run sees an uninterrupted one's."""

from __future__ import annotations

import tensorflow as tf

# The augmentations build graphs directly: AutoGraph has nothing to convert, it only slows tracing.
no_autograph = tf.autograph.experimental.do_not_convert


def branch_function(fn):
  """``fn`` as a TensorFlow function that graphs call instead of inlining it ('_noinline'): a
  tf.data map runs every op of every untaken `tf.cond` / `tf.switch_case` branch inlined into it
  (as a dead op, a few microseconds each); a branch that calls ``fn`` costs one."""
  return tf.function(fn, autograph=False, reduce_retracing=True,
                     experimental_attributes={'_noinline': True})


def split(seed: tf.Tensor, num: int):
  """`num` independent int64 [2] seeds derived from `seed`."""
  return tf.unstack(tf.random.experimental.stateless_split(seed, num))


def uniform(seed: tf.Tensor) -> tf.Tensor:
  """Scalar float64 uniform in [0, 1)."""
  return tf.random.stateless_uniform([], seed=seed, dtype=tf.float64)


def randint(seed: tf.Tensor, low, high) -> tf.Tensor:
  """Scalar int32 uniform in [low, high) (`high` > `low`, may be tensors)."""
  return tf.random.stateless_uniform([], seed=seed, minval=low, maxval=high, dtype=tf.int32)
