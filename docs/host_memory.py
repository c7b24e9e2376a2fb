r"""Resident memory of the training input pipeline's batch buffers, per image of per-host batch.

Each configuration runs in a fresh process: it builds `vit_jax.data.create_train_iterator` for one
process, takes a few batches at full speed, then consumes like a training loop that is slower than
the input (holds the batch and its `jax.Array` during a sleep of 3x a batch's production time),
so that every buffer fills; it prints the largest RSS seen after a sleep and VmHWM.

  python docs/host_memory.py --dir /tmp/hm/data [--batches 2,32,128,512] [--kinds folder,...]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time

import numpy as np
from PIL import Image

_SIZE = (500, 375)  # width, height


def _write_folder(root: str, count: int) -> None:
  rng = np.random.default_rng(0)
  for split, n in (('train', count), ('test', 10)):
    for k in range(n):
      d = os.path.join(root, split, f'class_{k % 10}')
      os.makedirs(d, exist_ok=True)
      coarse = Image.fromarray(rng.integers(0, 256, (15, 20, 3), np.uint8)).resize(
          _SIZE, Image.BICUBIC)
      pixels = np.asarray(coarse, np.float32) + rng.normal(0, 12, (*_SIZE[::-1], 3))
      buffer = io.BytesIO()
      Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, 'JPEG', quality=90)
      with open(os.path.join(d, f'img_{k}.jpg'), 'wb') as f:
        f.write(buffer.getvalue())


def _rss() -> tuple[int, int]:
  fields = {}
  with open('/proc/self/status') as f:
    for line in f:
      key, _, value = line.partition(':')
      fields[key] = value
  return int(fields['VmRSS'].split()[0]) * 1024, int(fields['VmHWM'].split()[0]) * 1024


def child(args) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  from vit_jax import config as config_lib  # pylint: disable=g-import-not-at-top
  from vit_jax import data  # pylint: disable=g-import-not-at-top
  cfg = config_lib.defaults.data_config()
  cfg.image_size = args.size
  cfg.prefetch = args.prefetch
  cfg.num_parallel_calls = args.parallel
  if args.kind == 'folder':
    cfg.image_folder = os.path.join(args.dir, 'folder')
    cfg.augment = 'inception_crop'
  else:
    cfg.name = 'fashion_mnist_local'
    cfg.data_dir = os.path.join(args.dir, 'tfds')
    cfg.manual_dir = '/usr/share/datasets/fashion-mnist'
    cfg.augment = 'flip'
    cfg.cache = args.kind == 'fmnist_cache'
  it = data.create_train_iterator(cfg, args.batch, seed=0, process_index=0, process_count=1)
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  start = time.perf_counter()
  for _ in range(3):
    batch = next(it)
  per_batch = (time.perf_counter() - start) / 3
  rss_fast = _rss()[0]
  peak = 0
  array = None
  for _ in range(args.steps):
    batch = next(it)
    if args.consumer == 'jax':
      array = jax.make_array_from_process_local_data(sharding, batch['image'])
      array.block_until_ready()
    time.sleep(max(3 * per_batch, 0.5))
    peak = max(peak, _rss()[0])
  del array
  print(json.dumps({'rss': peak, 'hwm': _rss()[1], 'rss_fast': rss_fast,
                    'per_batch_s': per_batch}))


def main() -> None:
  p = argparse.ArgumentParser()
  p.add_argument('--dir', required=True)
  p.add_argument('--batches', default='2,32,128,512')
  p.add_argument('--kinds', default='folder,fmnist_cache,fmnist')
  p.add_argument('--consumers', default='jax')
  p.add_argument('--prefetch', type=int, default=2)
  p.add_argument('--parallel', type=int, default=-1)
  p.add_argument('--size', type=int, default=224)
  p.add_argument('--steps', type=int, default=6)
  p.add_argument('--child', action='store_true')
  p.add_argument('--kind')
  p.add_argument('--batch', type=int)
  p.add_argument('--consumer')
  args = p.parse_args()
  if args.child:
    child(args)
    return
  folder = os.path.join(args.dir, 'folder')
  if not os.path.isdir(folder):
    _write_folder(folder, 1100)
  image = args.size * args.size * 3 * 4
  for kind in args.kinds.split(','):
    for consumer in args.consumers.split(','):
      rows = []
      for b in map(int, args.batches.split(',')):
        out = subprocess.run(
            [sys.executable, __file__, '--child', '--dir', args.dir, '--kind', kind, '--batch',
             str(b), '--consumer', consumer, '--prefetch', str(args.prefetch), '--parallel',
             str(args.parallel), '--size', str(args.size), '--steps', str(args.steps)],
            capture_output=True, text=True, check=True)
        rows.append((b, json.loads(out.stdout.strip().splitlines()[-1])))
      (b0, r0), mib = rows[0], 2**20
      for b, r in rows[1:]:
        rss, hwm = ((r[k] - r0[k]) / (b - b0) for k in ('rss', 'hwm'))
        print(f'{kind} consumer={consumer} prefetch={args.prefetch} parallel={args.parallel} '
              f'b={b}: RSS +{(r["rss"] - r0["rss"]) / mib:.0f} MiB = {rss / mib:.2f} MiB/image '
              f'({rss / image:.2f} copies), VmHWM {hwm / mib:.2f} MiB/image '
              f'({hwm / image:.2f} copies); {r["per_batch_s"]:.2f} s/batch', flush=True)


if __name__ == '__main__':
  main()
