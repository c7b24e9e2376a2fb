"""Host memory of the training input pipeline (shuffle buffer, cache or in-memory images, batch
buffers), estimated and logged at the start (the constants' measurements: docs/data.md)."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Tuple

from absl import logging
import numpy as np
import tensorflow as tf

from vit_jax import platform
from vit_jax.data import sources


#: tf.data's cost of one buffered element besides its image bytes (docs/data.md).
ELEMENT_OVERHEAD_BYTES = 600
#: Elements read to measure the image bytes of datasets without a static image size.
MEMORY_SAMPLE = 16
#: Batches held at once besides the prefetched ones and those in the per-batch map: the batch
#: being assembled, the map's inputs, the one the step holds and copies (docs/data.md).
BATCH_COPIES = 5.5
#: Batches in the per-batch map at ``config.data.num_parallel_calls=-1`` (tf.data's AUTOTUNE;
#: docs/data.md); an explicit value N holds N.
AUTOTUNE_IN_FLIGHT = 2


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


def estimate_shuffle_memory(data_cfg, source: sources.Source, split, num_examples: int, *,
                            sample: int = MEMORY_SAMPLE) -> ShuffleMemory:
  """The :class:`ShuffleMemory` of the train pipeline over ``split``: exact for decoded images of
  one static size, else the mean over its first ``sample`` images."""
  cache = bool(data_cfg.cache)
  decoded = cache or not source.images_encoded_after_read
  hw = source.static_image_hw
  if decoded and hw is not None:
    image_bytes = hw[0] * hw[1] * 3
    sampled = 0
  else:  # Decoded (uint8 H*W*3) or encoded bytes.
    mean, sampled = _mean_bytes(source, split, decoded, sample,
                                lambda ex: ex['image'].nbytes if decoded else len(ex['image']))
    image_bytes = round(mean)
  return ShuffleMemory(
      buffer_elements=min(int(data_cfg.shuffle_buffer), num_examples),
      bytes_per_element=image_bytes + ELEMENT_OVERHEAD_BYTES, decoded=decoded,
      cache_elements=num_examples if cache else 0, sampled=sampled)


def estimate_in_memory(source: sources.Source, split, num_examples: int, *,
                       sample: int = MEMORY_SAMPLE) -> Tuple[int, Optional[int]]:
  """``(bytes, sampled)`` of the decoded images and labels ``source.random_access(split,
  decode=True)`` will hold: exact (sampled 0) for one static image size and single labels, else
  ``num_examples`` x the mean of the first ``sample`` (sampled: how many read; None: none)."""
  hw = source.static_image_hw
  if hw is not None and not source.label.multi_label:
    return num_examples * (hw[0] * hw[1] * 3 + 8), 0
  mean, sampled = _mean_bytes(source, split, True, sample,
                              lambda ex: ex['image'].nbytes + ex['label'].nbytes)
  return round(num_examples * mean), sampled


def _mean_bytes(source: sources.Source, split, decode: bool, sample: int,
                size: Callable[[dict], int]) -> Tuple[float, Optional[int]]:
  """``(mean size(example), examples read)`` over the first ``sample`` examples of ``split``;
  ``(0, None)`` when none can be read (the pipeline itself will say why)."""
  ds = source.read(split, decode=decode).take(sample).ignore_errors()
  try:
    sizes = [size(ex) for ex in ds.as_numpy_iterator()]
  except tf.errors.OpError:
    sizes = []
  return (float(np.mean(sizes)), len(sizes)) if sizes else (0., None)


def _size(n: float) -> str:
  for unit in ('B', 'KiB', 'MiB', 'GiB'):
    if n < 1024 or unit == 'GiB':
      return f'{n:.0f} {unit}' if unit == 'B' else f'{n:.1f} {unit}'
    n /= 1024


@dataclasses.dataclass(frozen=True)
class InputMemory:
  """One process's input pipeline: the ``shuffle`` buffer and tf.data cache (None: read by index),
  the decoded images read by index (:func:`estimate_in_memory`), and (``prefetch`` +
  ``in_flight`` + ``BATCH_COPIES``) batches of ``local_batch`` float32 ``[S, S, 3]`` images and
  ``[C]`` labels (S = ``image_size``, C = ``num_classes``)."""
  shuffle: Optional[ShuffleMemory]
  in_memory_bytes: int
  local_batch: int
  image_size: int
  num_classes: int
  prefetch: int
  in_flight: int
  in_memory_sampled: Optional[int] = 0

  @property
  def element_bytes(self) -> int:
    """Bytes of one batch element: float32 image and labels."""
    return 4 * (self.image_size * self.image_size * 3 + self.num_classes)

  @property
  def batch_copies(self) -> float:
    return self.prefetch + self.in_flight + BATCH_COPIES

  @property
  def batch_bytes(self) -> int:
    return round(self.local_batch * self.element_bytes * self.batch_copies)

  @property
  def shuffle_bytes(self) -> int:
    """The shuffle buffer's own bytes (0 when it shares the cache's tensors)."""
    return 0 if self.shuffle is None or self.shuffle.cache_elements else self.shuffle.buffer_bytes

  @property
  def cache_bytes(self) -> int:
    """The tf.data cache's or the in-memory images' bytes."""
    return self.in_memory_bytes + (self.shuffle.cache_bytes if self.shuffle else 0)

  @property
  def total_bytes(self) -> int:
    return self.shuffle_bytes + self.cache_bytes + self.batch_bytes


def estimate_input_memory(data_cfg, local_batch: int, num_classes: int, *,
                          shuffle: Optional[ShuffleMemory] = None,
                          in_memory_bytes: int = 0,
                          in_memory_sampled: Optional[int] = 0) -> InputMemory:
  """The :class:`InputMemory` of a process's train pipeline: ``shuffle`` from
  :func:`estimate_shuffle_memory` (None: read by index), ``in_memory_*`` from
  :func:`estimate_in_memory`."""
  parallel = int(data_cfg.num_parallel_calls)
  in_flight = parallel if parallel > 0 else AUTOTUNE_IN_FLIGHT
  return InputMemory(shuffle, int(in_memory_bytes), int(local_batch), int(data_cfg.image_size),
                     int(num_classes), int(data_cfg.prefetch), in_flight, in_memory_sampled)


def _how(sampled: Optional[int]) -> str:
  if sampled == 0:
    return 'exact'
  if sampled is None:
    return 'size unknown: no image read'
  return f'mean of {sampled} read'


def _shuffle_text(m: ShuffleMemory) -> str:
  what = 'decoded uint8 images' if m.decoded else 'encoded images'
  how = _how(m.sampled)
  cache = (f'; the cache (config.data.cache) holds {m.cache_elements:,} decoded images = '
           f'{_size(m.cache_bytes)}, whose tensors the buffer shares' if m.cache_elements else '')
  return (f'shuffle buffer {m.buffer_elements:,} elements x {_size(m.bytes_per_element)} ({what}, '
          f'{how}; +{ELEMENT_OVERHEAD_BYTES} B per element) = {_size(m.buffer_bytes)}{cache}')


def _fix(m: InputMemory, ram: int) -> str:
  """What the biggest part of ``m`` needs and how to lower it."""
  parts = {'shuffle': m.shuffle_bytes, 'cache': m.cache_bytes, 'batches': m.batch_bytes}
  biggest = max(parts, key=parts.get)  # Ties: the first (dict order).
  if biggest == 'shuffle':
    s = m.shuffle
    fits = max(1, int(ram // 4 // s.bytes_per_element))
    return (f'the shuffle buffer ({s.buffer_elements:,} elements x {_size(s.bytes_per_element)}, '
            f'config.data.shuffle_buffer) needs ~{_size(s.buffer_bytes)}. Lower it, e.g. '
            f'--config.data.shuffle_buffer={fits} (a quarter of the RAM).')
  if biggest == 'cache':
    return (f'the decoded training images held in memory (config.data.cache) need '
            f'~{_size(m.cache_bytes)}. Set --config.data.cache=False (images are then decoded '
            'every epoch).')
  held = (f'the batch buffers ({m.batch_copies:g} batches of {m.local_batch:,} x '
          f'{_size(m.element_bytes)}) need ~{_size(m.batch_bytes)}. ')
  if m.prefetch > max(m.in_flight, BATCH_COPIES):
    return held + (f'Most are prefetched (config.data.prefetch={m.prefetch}): lower it, e.g. '
                   '--config.data.prefetch=2.')
  if m.in_flight > BATCH_COPIES:
    return held + (f'Most are in the per-batch map (config.data.num_parallel_calls='
                   f'{m.in_flight}): lower it, e.g. --config.data.num_parallel_calls=-1 '
                   '(AUTOTUNE).')
  fits = max(1, int(ram // 4 // (m.element_bytes * m.batch_copies)))
  return held + (f'Lower the batch per host (config.batch_size / processes = {m.local_batch:,}; '
                 f'{fits:,} fill a quarter of the RAM): a smaller --config.batch_size, or more '
                 'hosts.')


def log_input_memory(memory: InputMemory, process: str = '', ram_bytes: Optional[int] = None,
                     share: float = 0.5) -> Optional[str]:
  """Logs ``memory`` in one line; above ``share`` of the RAM (default this host's) also a WARNING
  naming the fix of its biggest part, which it returns."""
  ram = platform.host_memory_bytes() if ram_bytes is None else ram_bytes
  m = memory
  parts = [_shuffle_text(m.shuffle) if m.shuffle else 'shuffle buffer none (read by index)']
  if m.in_memory_bytes or m.in_memory_sampled is None:
    parts.append(f'decoded images in memory (config.data.cache) = {_size(m.in_memory_bytes)} '
                 f'({_how(m.in_memory_sampled)})')
  s = m.image_size
  parts.append(f'batch buffers {m.batch_copies:g} x {m.local_batch:,} examples x '
               f'{_size(m.element_bytes)} (float32 {s}x{s}x3 image + {m.num_classes:,} labels; '
               f'prefetch {m.prefetch} + per-batch map {m.in_flight} + {BATCH_COPIES:g} more) = '
               f'{_size(m.batch_bytes)}')
  of_ram = f' of {_size(ram)} host RAM ({m.total_bytes / ram:.0%})' if ram else ''
  logging.info('Input pipeline host memory%s: %s; total ~%s%s.', process, '; '.join(parts),
               _size(m.total_bytes), of_ram)
  if not ram or m.total_bytes <= share * ram:
    return None
  message = (f'The input pipeline needs ~{_size(m.total_bytes)} of host memory, more than '
             f'{share:.0%} of this host\'s {_size(ram)} of RAM: the process may be killed for lack '
             f'of memory. Its biggest part: {_fix(m, ram)}')
  logging.warning('%s', message)
  return message
