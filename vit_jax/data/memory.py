"""Host memory of the training pipeline's shuffle buffer and cache, estimated and logged at the
start (the measurements behind the constants: docs/data.md)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from absl import logging
import numpy as np
import tensorflow as tf

from vit_jax import platform
from vit_jax.data import sources


#: tf.data's cost of one buffered element besides its image bytes (docs/data.md).
ELEMENT_OVERHEAD_BYTES = 600
#: Elements read to measure the image bytes of datasets without a static image size.
MEMORY_SAMPLE = 16


@dataclasses.dataclass(frozen=True)
class ShuffleMemory:
  """One process's shuffle buffer and cache: elements, bytes per element (image +
  ``ELEMENT_OVERHEAD_BYTES``), whether ``decoded``, and the images ``sampled`` (0: exact; None:
  none read)."""
  buffer_elements: int
  bytes_per_element: int
  decoded: bool
  cache_elements: int
  sampled: Optional[int]

  @property
  def buffer_bytes(self) -> int:
    return self.buffer_elements * self.bytes_per_element

  @property
  def cache_bytes(self) -> int:
    return self.cache_elements * self.bytes_per_element

  @property
  def total_bytes(self) -> int:
    """The cache's bytes when caching (the buffer shares its tensors), else the buffer's."""
    return self.cache_bytes if self.cache_elements else self.buffer_bytes


def _sample_image_bytes(source: sources.Source, split, decoded: bool, sample: int) -> list:
  """Bytes of the first `sample` images of `split`, decoded (uint8 H*W*3) or encoded."""
  if source.is_image_folder:  # Only the files needed (read_file is the encoded element).
    paths = source.split_paths(split)[:sample]
    ds = tf.data.Dataset.from_tensor_slices(tf.constant(paths, tf.string)).map(
        lambda p: {'image': tf.io.read_file(p)})
    if decoded:
      ds = ds.map(lambda ex: {'image': source.decode(ex['image'], True)})
  else:
    ds = source.read(split, decode=decoded).take(sample)
  try:
    return [ex['image'].nbytes if decoded else len(ex['image'])
            for ex in ds.ignore_errors().as_numpy_iterator()]
  except tf.errors.OpError:  # Unreadable: the pipeline itself will say why.
    return []


def estimate_shuffle_memory(data_cfg, source: sources.Source, split, num_examples: int, *,
                            sample: int = MEMORY_SAMPLE) -> ShuffleMemory:
  """The :class:`ShuffleMemory` of the train pipeline over ``split``: exact for decoded images of
  one static size, else the mean over its first ``sample`` images."""
  cache = bool(data_cfg.cache)
  decoded = cache or not source.images_encoded_after_read
  hw = source.static_image_hw
  if decoded and hw is not None:
    image_bytes, sampled = hw[0] * hw[1] * 3, 0
  else:
    sizes = _sample_image_bytes(source, split, decoded, sample)
    image_bytes, sampled = (round(float(np.mean(sizes))), len(sizes)) if sizes else (0, None)
  return ShuffleMemory(
      buffer_elements=min(int(data_cfg.shuffle_buffer), num_examples),
      bytes_per_element=image_bytes + ELEMENT_OVERHEAD_BYTES, decoded=decoded,
      cache_elements=num_examples if cache else 0, sampled=sampled)


def _size(n: float) -> str:
  for unit in ('B', 'KiB', 'MiB', 'GiB'):
    if n < 1024 or unit == 'GiB':
      return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.1f} {unit}'
    n /= 1024


def log_shuffle_memory(memory: ShuffleMemory, process: str = '',
                       ram_bytes: Optional[int] = None, share: float = 0.5) -> Optional[str]:
  """Logs ``memory``; above ``share`` of the RAM (default this host's) also a WARNING naming the
  fix (no cache, or a quarter of the RAM's buffer), which it returns."""
  ram = platform.host_memory_bytes() if ram_bytes is None else ram_bytes
  m = memory
  what = 'decoded uint8 images' if m.decoded else 'encoded images'
  how = ('exact' if m.sampled == 0 else 'size unknown: no image read' if m.sampled is None
         else f'mean of {m.sampled} read')
  cache = (f'; the cache (config.data.cache) holds {m.cache_elements:,} decoded images = '
           f'{_size(m.cache_bytes)}, whose tensors the buffer shares' if m.cache_elements else '')
  of_ram = f' of {_size(ram)} host RAM ({m.total_bytes / ram:.0%})' if ram else ''
  logging.info('Input pipeline host memory%s: shuffle buffer %s elements x %s (%s, %s; '
               '+%d B per element) = %s%s; total ~%s%s.', process, f'{m.buffer_elements:,}',
               _size(m.bytes_per_element), what, how, ELEMENT_OVERHEAD_BYTES,
               _size(m.buffer_bytes), cache, _size(m.total_bytes), of_ram)
  if not ram or m.total_bytes <= share * ram:
    return None
  if m.cache_elements:
    message = (f'The in-memory cache of decoded training images (config.data.cache) needs '
               f'~{_size(m.cache_bytes)}, more than {share:.0%} of this host\'s '
               f'{_size(ram)} of RAM: the process may be killed for lack of memory. Set '
               '--config.data.cache=False (images are then decoded every epoch and the shuffle '
               'buffer holds encoded bytes).')
  else:
    fits = max(1, int(ram // 4 // m.bytes_per_element))
    message = (f'The shuffle buffer ({m.buffer_elements:,} elements x '
               f'{_size(m.bytes_per_element)}, config.data.shuffle_buffer) needs '
               f'~{_size(m.buffer_bytes)}, more than {share:.0%} of this host\'s {_size(ram)} of '
               'RAM: the process may be killed for lack of memory. Lower it, e.g. '
               f'--config.data.shuffle_buffer={fits} (a quarter of the RAM).')
  logging.warning('%s', message)
  return message
