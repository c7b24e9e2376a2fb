"""Measures every variant of the CPU attention kernel against XLA's attention on this CPU.

Each variant (``cpu_attention.ISAS``) this CPU can run is compiled from ``cpu_attention.cc``
into a temporary folder and loaded in a fresh process (``cpu_attention.load``), which measures
--core: the attention core alone, forward + backward at each model's shapes (197 tokens, head
size 64), the kernel on ``[B, N, 3, heads, Dh]`` against XLA's on ``[B, heads, N, Dh]``; or
--step: the benchmark's training step (``benchmarks.ours``) with ``attention='cpu_kernel'`` and
with ``'xla'``, under the huge-page malloc, alternating. Wall and process CPU time (all
threads); medians over the calls of a process, then over --rounds processes. The evidence for
``cpu_attention.MEASURED`` (docs/kernels.md).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp

from benchmarks import common as bench_common
from benchmarks import ours
from vit_jax import platform
from vit_jax import step as step_lib
from vit_jax.kernels import build
from vit_jax.kernels import cpu_attention
from vit_jax.models import attention as attention_lib
from vit_jax.tools import common

HEADS = {'ViT-Ti_16': 3, 'ViT-S_16': 6, 'ViT-B_16': 12}
TOKENS, HEAD_DIM = 197, 64


def _medians(times: dict[str, list[float]]) -> dict[str, float]:
  """Each series' median, and its minimum as 'min_<name>'."""
  return {k: statistics.median(v) for k, v in times.items()} | {
      f'min_{k}': min(v) for k, v in times.items()}


def _core_worker(heads: int, batch: int, repeats: int) -> dict[str, Any]:
  """Median and minimum ms (wall and CPU) of the kernel's and XLA's core, alternating."""
  scale = HEAD_DIM ** -0.5
  keys = jax.random.split(jax.random.key(0), 3)
  qkv = jax.random.normal(keys[0], (batch, TOKENS, 3, heads, HEAD_DIM), jnp.float32)
  weights = jax.random.normal(keys[1], (batch, TOKENS, heads, HEAD_DIM), jnp.float32)
  q, k, v = jnp.transpose(qkv, (2, 0, 3, 1, 4))  # [B, heads, N, Dh] each.
  weights_xla = jnp.swapaxes(weights, 1, 2)

  def kernel_loss(a):
    return jnp.sum(cpu_attention.attention(a, logits_scale=scale) * weights)

  def xla_loss(q, k, v):
    return jnp.sum(attention_lib.dot_product_attention(q, k, v, logits_scale=scale) * weights_xla)

  runs = {'kernel': (jax.jit(jax.value_and_grad(kernel_loss)), (qkv,)),
          'xla': (jax.jit(jax.value_and_grad(xla_loss, argnums=(0, 1, 2))), (q, k, v))}
  times: dict[str, list[float]] = {f'{name}{kind}': [] for name in runs
                                   for kind in ('_ms', '_cpu_ms')}
  for fn, args in runs.values():
    jax.block_until_ready(fn(*args))  # Compile and warm up.
  for _ in range(repeats):
    for name, (fn, args) in runs.items():
      start, cpu = time.perf_counter(), time.process_time()
      jax.block_until_ready(fn(*args))
      times[f'{name}_ms'].append(1e3 * (time.perf_counter() - start))
      times[f'{name}_cpu_ms'].append(1e3 * (time.process_time() - cpu))
  return _medians(times)


def _step_worker(model: str, batch: int, steps: int) -> dict[str, Any]:
  """Median and minimum seconds (wall, CPU) of the step with each attention, run in turns."""
  runs = {}
  for attention in ('xla', 'cpu_kernel'):  # The benchmark's training step at 224 px.
    config, _ = ours.resolve(ours.benchmark_config(
        model, batch=batch, resolution=224, overrides={'attention': attention}), jax.devices())
    setup = step_lib.build(config, image_shape=(224, 224, 3))
    compiled = ours.compile_step(setup, 'train', batch).compiled
    state, data = ours.train_inputs(setup, batch)
    if cpu_attention.called_by(compiled) != (attention == 'cpu_kernel'):
      raise RuntimeError(f'the step compiled with attention={attention!r} does not run what '
                         'it should (vit_jax.kernels.cpu_attention.called_by)')
    runs[attention] = {'compiled': compiled, 'state': state, 'data': data}
  times: dict[str, list[float]] = {f'{a}_{k}': [] for a in runs for k in ('s', 'cpu_s')}
  for i in range(steps + 1):
    for attention, run in runs.items():
      start, cpu = time.perf_counter(), time.process_time()
      run['state'], metrics = run['compiled'](run['state'], run['data'])
      jax.block_until_ready((run['state'], metrics))
      if i:  # The first of each is a warm-up.
        times[f'{attention}_s'].append(time.perf_counter() - start)
        times[f'{attention}_cpu_s'].append(time.process_time() - cpu)
  result = _medians(times)
  return dict(result, kernel_images_per_sec=batch / result['cpu_kernel_s'],
              xla_images_per_sec=batch / result['xla_s'])


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
  """One measurement in this fresh process, after pinning its cores and loading its variant."""
  if spec.get('threads'):  # Before JAX's CPU client exists: it sizes its pool from these.
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:spec['threads']])
    os.environ['NPROC'] = str(spec['threads'])
  if spec.get('library'):
    path, reason = cpu_attention.load(spec['library'])
    if path is None:
      raise RuntimeError(reason)
  load_before = os.getloadavg()[0]
  if spec['what'] == 'core':
    result = _core_worker(spec['heads'], spec['batch'], spec['repeats'])
  else:
    result = _step_worker(spec['model'], spec['batch'], spec['steps'])
  return dict(result, isa=cpu_attention.isa() if spec.get('library') else None,
              load_average=(load_before, os.getloadavg()[0]))


def _run_worker(spec: dict[str, Any], environ: Optional[dict[str, str]] = None
                ) -> dict[str, Any]:
  out = subprocess.run([sys.executable, '-m', 'benchmarks.measure_attention', '--worker',
                        json.dumps(spec)], capture_output=True, text=True, check=False,
                       env=bench_common.worker_environment(environ))
  if out.returncode:
    raise RuntimeError(f'measurement {spec} failed:\n{out.stderr[-3000:]}')
  return json.loads(out.stdout.strip().splitlines()[-1])


def build_variants(isas: Sequence[str], folder: str) -> dict[str, str]:
  """``{isa: path}`` of one library per variant compiled into ``folder``."""
  paths = {isa: os.path.join(folder, f'cpu_attention_{isa}.so') for isa in isas}
  for isa, path in paths.items():
    subprocess.run(build.compile_command(path, isa=isa), check=True, capture_output=True)
  return paths


def measure(isas: Sequence[str], models: Sequence[str], *, core: bool, step: bool, batch: int,
            rounds: int, steps: int, repeats: int, threads: Optional[int] = None
            ) -> dict[str, Any]:
  """Every measurement of the module docstring: each round, and medians over the rounds."""
  best = cpu_attention.isa()  # The installed library's variant: it and those below it run.
  if best is None:
    raise RuntimeError(f'the kernel is not built: {cpu_attention.library()[1]}')
  runnable = cpu_attention.ISAS[cpu_attention.ISAS.index(best):]
  report: dict[str, Any] = {'cannot_run_here': [i for i in isas if i not in runnable],
                            'rounds': [], 'cpu': bench_common.cpu_info().get('model name', 'unknown'),
                            'threads': threads or len(os.sched_getaffinity(0))}
  isas = [i for i in isas if i in runnable]
  step_environ = platform.huge_pages_environment() or dict(os.environ)
  with tempfile.TemporaryDirectory() as folder:
    libraries = build_variants(isas, folder)
    whats = [what for what, asked in (('core', core), ('step', step)) if asked]
    for r in range(rounds):
      for model, what, isa in itertools.product(models, whats, isas):
        result = _run_worker({'what': what, 'library': libraries[isa], 'model': model,
                              'heads': HEADS[model], 'batch': batch, 'repeats': repeats,
                              'steps': steps, 'threads': threads},
                             step_environ if what == 'step' else None)
        report['rounds'].append(dict(result, round=r, what=what, model=model, isa=isa))
        print(json.dumps(report['rounds'][-1]), flush=True)
  report['summary'] = _summary(report['rounds'])
  return report


def _summary(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
  rows = []
  for (what, model, isa) in dict.fromkeys((r['what'], r['model'], r['isa']) for r in rounds):
    mine = [r for r in rounds if (r['what'], r['model'], r['isa']) == (what, model, isa)]
    keys = [k for k, v in mine[0].items()
            if isinstance(v, float) and k not in ('round', 'load_average')]
    rows.append({'what': what, 'model': model, 'isa': isa, 'rounds': len(mine),
                 **{k: statistics.median(r[k] for r in mine) for k in keys}})
  return rows


def format_summary(report: dict[str, Any]) -> str:
  """Markdown tables of the medians: the core (ms) and the training step (images/s)."""
  lines = []
  for what, wall, cpu, keys, spec in (
      ('core', 'kernel fwd+bwd (ms) | XLA fwd+bwd (ms)', 'kernel CPU ms | XLA CPU ms',
       ('kernel_ms', 'xla_ms', 'kernel_cpu_ms', 'xla_cpu_ms'), '.1f'),
      ('step', 'kernel step (s) | XLA step (s)', 'kernel CPU s | XLA CPU s',
       ('cpu_kernel_s', 'xla_s', 'cpu_kernel_cpu_s', 'xla_cpu_s'), '.2f')):
    rows = [r for r in report['summary'] if r['what'] == what]
    if rows:
      lines += [''] * (what == 'step') + [
          f'| model | variant | {wall} | kernel / XLA | {cpu} | kernel / XLA (CPU) |',
          '|---' * 8 + '|']
    for r in rows:
      k, x, kc, xc = (r[key] for key in keys)
      lines.append(f"| {r['model']} | {r['isa']} | {k:{spec}} | {x:{spec}} | {k / x:.2f} | "
                   f"{kc:{spec}} | {xc:{spec}} | {kc / xc:.2f} |")
  for isa in report['cannot_run_here']:
    lines.append(f'\n{isa}: this CPU cannot run it (no {isa} instructions); not measured.')
  return '\n'.join(lines)


def _parser() -> common.Parser:
  parser = common.Parser(prog='python -m benchmarks.measure_attention', description=__doc__)
  parser.add_argument('--isa', nargs='+', choices=cpu_attention.ISAS,
                      default=list(cpu_attention.ISAS))
  parser.add_argument('--models', nargs='+', choices=sorted(HEADS),
                      default=['ViT-Ti_16', 'ViT-S_16'])
  parser.add_argument('--core', action='store_true', help='the attention core alone')
  parser.add_argument('--step', action='store_true', help='the whole training step')
  parser.add_argument('--batch', type=int, default=32)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--steps', type=int, default=5,
                      help='timed training steps of each attention per process')
  parser.add_argument('--repeats', type=int, default=10, help='timed core calls per process')
  parser.add_argument('--threads', type=int,
                      help='pin each measuring process to this many cores (default: all)')
  parser.add_argument('--json', help='write every round and the summary here')
  parser.add_argument('--worker', help=argparse.SUPPRESS)
  return parser


@common.exit_status
def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  if args.worker:
    print(json.dumps(_worker(json.loads(args.worker))))
    return 0
  if not (args.core or args.step):
    parser.error('say what to measure: --core, --step or both')
  common.check_output_folder(args.json, '--json')  # Before minutes of measuring, not after.
  report = measure(args.isa, args.models, core=args.core, step=args.step, batch=args.batch,
                   rounds=args.rounds, steps=args.steps, repeats=args.repeats,
                   threads=args.threads)
  print(format_summary(report))  # First: a --json that cannot be written loses no figure.
  if args.json:
    with common.output_errors(), open(args.json, 'w', encoding='utf-8') as f:
      json.dump(report, f, indent=1)
  return 0


def run_main() -> None:
  common.run_program(main, _parser, setup=lambda: None)  # Each measuring process sets itself up.


if __name__ == '__main__':
  run_main()
