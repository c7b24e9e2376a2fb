"""Writes ``imagenet1k.txt`` and ``imagenet21k.txt`` beside this file from timm's data files.

A maintenance script, never imported by the package::

  pip download timm==1.0.15 --no-deps -d /tmp/timmdl
  python vit_jax/labels/make_label_files.py /tmp/timmdl/timm-1.0.15-py3-none-any.whl

(or an unpacked ``timm/data/_info`` directory). The synset lists and lemmas it reads:
``README.md`` here. It writes one name per class, per line, in label order (:func:`short_names`).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import zipfile
from typing import Dict, List, Sequence

#: Output file -> timm's synset list of that label set.
OUTPUTS = {'imagenet1k.txt': 'imagenet_synsets.txt',
           'imagenet21k.txt': 'imagenet21k_goog_synsets.txt'}
LEMMAS = 'imagenet_synset_to_lemma.txt'
EXPECTED_COUNTS = {'imagenet1k.txt': 1000, 'imagenet21k.txt': 21843}
_INFO = 'timm/data/_info/'


def read_timm_file(source: str, name: str) -> str:
  """The text of ``timm/data/_info/<name>`` from a timm wheel (zip) or an ``_info`` directory."""
  if zipfile.is_zipfile(source):
    with zipfile.ZipFile(source) as wheel:
      return wheel.read(_INFO + name).decode('utf-8')
  with open(os.path.join(source, name), encoding='utf-8') as f:
    return f.read()


def short_names(synsets: Sequence[str], lemmas: Dict[str, List[str]]) -> List[str]:
  """One name per synset, unique (ignoring case): its first WordNet lemma, 'first (second)' where
  that is shared ('maillot (tank suit)'), then the synset id ('crane (n02012849)')."""
  names = [lemmas[s][0] for s in synsets]
  counts = collections.Counter(n.lower() for n in names)
  for i, s in enumerate(synsets):
    if counts[names[i].lower()] > 1 and len(lemmas[s]) > 1:
      names[i] = f'{lemmas[s][0]} ({lemmas[s][1]})'
  counts = collections.Counter(n.lower() for n in names)
  for i, s in enumerate(synsets):
    if counts[names[i].lower()] > 1:
      names[i] = f'{lemmas[s][0]} ({s})'
  assert len({n.lower() for n in names}) == len(names), 'names are not unique'
  return names


def main(argv: Sequence[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('timm', help='a timm wheel (.whl) or its unpacked timm/data/_info folder')
  parser.add_argument('--out', default=os.path.dirname(os.path.abspath(__file__)),
                      help='output folder (default: beside this script)')
  args = parser.parse_args(argv)
  lemmas = {}
  for line in read_timm_file(args.timm, LEMMAS).splitlines():
    if line.strip():
      synset, text = line.split('\t', 1)
      lemmas[synset] = [w.strip() for w in text.split(',') if w.strip()]
  for out, synset_file in OUTPUTS.items():
    synsets = read_timm_file(args.timm, synset_file).split()
    if len(synsets) != EXPECTED_COUNTS[out]:
      raise SystemExit(f'{synset_file}: {len(synsets)} synsets, expected {EXPECTED_COUNTS[out]}.')
    names = short_names(synsets, lemmas)
    with open(os.path.join(args.out, out), 'w', encoding='utf-8', newline='\n') as f:
      f.write('\n'.join(names) + '\n')
    print(f'Wrote {os.path.join(args.out, out)}: {len(names)} names '
          f'({names[0]!r} ... {names[-1]!r}).')
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
