"""Class names of the official checkpoints' label sets, shipped with the package.

``official_label_names(1000)``: ImageNet-1k (ILSVRC-2012) in the order of the official ViT and
T2T-ViT heads; ``official_label_names(21843)``: ImageNet-21k (fall 2011 release) in the order of
the official ViT ImageNet-21k heads. The files and how they were made: ``README.md`` here.
"""

from __future__ import annotations

import functools
import importlib.resources
from typing import Optional, Tuple

#: Class count -> the file of its names (one per line, in label order).
FILES = {1000: 'imagenet1k.txt', 21843: 'imagenet21k.txt'}


@functools.lru_cache(maxsize=None)
def official_label_names(num_classes: int) -> Optional[Tuple[str, ...]]:
  """The class names of an official checkpoint's head of ``num_classes`` outputs, or None for
  a class count without a shipped label set (or when the file is missing)."""
  name = FILES.get(int(num_classes))
  if name is None:
    return None
  resource = importlib.resources.files(__name__) / name
  if not resource.is_file():
    return None
  names = tuple(line.rstrip('\n') for line in resource.read_text(encoding='utf-8').splitlines())
  return names if len(names) == num_classes else None
