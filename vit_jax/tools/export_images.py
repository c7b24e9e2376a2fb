"""Writes examples of a dataset as PNG files named by their labels, e.g. to try predict on.

  python -m vit_jax.tools.export_images --data fashion_mnist_local --split 'test[:10]' --out DIR

writes ``DIR/<index>_<label>.png`` (``0_Ankle boot.png``, ...): ``index`` is the position in
the split (for ``fashion_mnist_local`` in the published IDX files), ``label`` the class name
(characters a file name cannot hold become '_'; several labels joined with '+'), the pixels
lossless. Bad input is one ``FATAL:`` line and exit status 2.
"""

from __future__ import annotations

import os
import re
from typing import List, Optional, Sequence

from vit_jax.tools import common


def _file_label(names: Sequence[str], label) -> str:
  labels = [int(label)] if getattr(label, 'ndim', 0) == 0 else [int(x) for x in label]
  text = '+'.join(names[i] if i < len(names) else str(i) for i in labels) or 'none'
  return re.sub(r'[^\w .,()+-]', '_', text)


def _examples(source, data: str, split: str):
  """The split's examples as numpy dicts (fashion_mnist_local: in the published IDX order)."""
  if data != 'fashion_mnist_local':
    yield from source.read(split, decode=True).as_numpy_iterator()
    return
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  from vit_jax.data import fashion_mnist_local  # pylint: disable=g-import-not-at-top
  splits = source.builder.info.splits
  for instruction in tfds.core.ReadInstruction.from_spec(split).to_absolute(splits):
    images, labels = fashion_mnist_local.load_split(
        source.builder._source_dir(), instruction.splitname)  # pylint: disable=protected-access
    end = splits[instruction.splitname].num_examples if instruction.to is None else instruction.to
    for i in range(instruction.from_ or 0, end):
      yield {'image': images[i][..., None], 'label': labels[i]}


def export(data: str, split: str, out: str, data_dir: Optional[str] = None) -> List[str]:
  """Writes the examples of ``split`` of ``data`` to ``out`` as PNGs; returns their paths.
  Raises as ``vit_jax.data.get_info``."""
  from vit_jax.config import defaults  # pylint: disable=g-import-not-at-top
  from vit_jax.data import sources  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  config = defaults.data_config()
  config.name, config.data_dir = data, data_dir
  source = sources.get_source(config)
  count = source.num_examples(split)
  width = len(str(max(count - 1, 0)))
  os.makedirs(out, exist_ok=True)
  written = []
  for index, example in enumerate(_examples(source, data, split)):
    image = example['image']
    if (image == image[..., :1]).all():
      image = image[..., :1]
    label = _file_label(source.label.names, example['label'])
    path = os.path.join(out, f'{index:0{width}d}_{label}.png')
    with open(path, 'wb') as f:
      f.write(tf.io.encode_png(np.ascontiguousarray(image)).numpy())
    written.append(path)
  return written


def _parser() -> common.Parser:
  parser = common.Parser(prog='python -m vit_jax.tools.export_images', description=__doc__)
  parser.add_argument('--data', required=True, help='a tfds dataset name or prepared directory')
  parser.add_argument('--split', default='test[:10]', help="tfds split (default 'test[:10]')")
  parser.add_argument('--out', required=True, help='folder to write to (created)')
  parser.add_argument('--data-dir', help='tfds data_dir (default: tfds\'s)')
  return parser


@common.exit_status
def main(argv: Optional[Sequence[str]] = None) -> int:
  args = _parser().parse_args(argv)
  written = export(args.data, args.split, args.out, args.data_dir)
  print(f'Wrote {len(written)} images to {args.out}.')
  return 0


def run_main() -> None:
  common.run_program(main, _parser)


if __name__ == '__main__':
  run_main()
