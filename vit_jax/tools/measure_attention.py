"""Measures every variant of the CPU attention kernel against XLA's attention on this CPU.

Usage:
  python -m vit_jax.tools.measure_attention [--isa avx2 baseline] [--core] [--step]
      [--models ViT-Ti_16 ViT-S_16] [--batch 32] [--rounds 3] [--steps 5] [--repeats 10]
      [--threads N] [--json PATH]

For each variant (``cpu_attention.ISAS``) that this CPU can run (the installed library's own
and the ones below it), it compiles ``cpu_attention.cc`` restricted to that variant
(``build.compile_command(..., isa=...)``, g++ into a temporary folder) and, in a fresh process
that loads that build in place of the installed library (``cpu_attention.load``), measures:

  --core  the attention core alone, forward + backward (``jax.value_and_grad`` of a weighted
          sum), at each model's shapes (batch --batch, 197 tokens, its heads, head size 64):
          the kernel on ``[B, N, 3, heads, Dh]`` against
          ``vit_jax.models.attention.dot_product_attention`` on ``[B, heads, N, Dh]`` (the
          layout of the models' XLA path); --repeats calls of each, alternating. Wall and
          process CPU milliseconds (all threads) per call.
  --step  the whole training step of each model at batch --batch, the trainer's
          (``vit_jax.step``) with the benchmark's config, compiled once with
          ``attention='cpu_kernel'`` and once with ``attention='xla'``, in one process under
          the huge-page allocator settings of ``vit_jax.platform.huge_pages_environment``;
          --steps steps of each after one warm-up, alternating, so that both meet the same
          load. Wall seconds and the process's CPU seconds (all threads) per step.

Every figure is a median: over the calls or steps of a process, then over --rounds processes.
--threads N pins each process to N cores and sizes XLA's thread pool to N (``NPROC``). A
variant this CPU lacks (e.g. avx512 on an AVX2 CPU) cannot run here and is listed as such.
The results are the evidence for ``cpu_attention.MEASURED`` (docs/kernels.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional, Sequence

#: The ViT models that can be measured, with their attention heads (head size 64 in each).
HEADS = {'ViT-Ti_16': 3, 'ViT-S_16': 6, 'ViT-B_16': 12}
TOKENS, HEAD_DIM = 197, 64


def _core_worker(heads: int, batch: int, repeats: int) -> dict[str, Any]:
  """Median and minimum ms of the kernel's and XLA's core, forward + backward, alternating:
  wall time and the process's CPU time (all threads)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from vit_jax.kernels import cpu_attention  # pylint: disable=import-outside-toplevel
  from vit_jax.models import attention  # pylint: disable=import-outside-toplevel
  scale = HEAD_DIM ** -0.5
  keys = jax.random.split(jax.random.key(0), 3)
  qkv = jax.random.normal(keys[0], (batch, TOKENS, 3, heads, HEAD_DIM), jnp.float32)
  weights = jax.random.normal(keys[1], (batch, TOKENS, heads, HEAD_DIM), jnp.float32)
  q, k, v = jnp.transpose(qkv, (2, 0, 3, 1, 4))  # [B, heads, N, Dh] each.
  weights_xla = jnp.swapaxes(weights, 1, 2)

  def kernel_loss(a):
    return jnp.sum(cpu_attention.attention(a, logits_scale=scale) * weights)

  def xla_loss(q, k, v):
    return jnp.sum(attention.dot_product_attention(q, k, v, logits_scale=scale) * weights_xla)

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
  return {k: statistics.median(v) for k, v in times.items()} | {
      f'min_{k}': min(v) for k, v in times.items()}


def _train_step(model: str, attention: str, batch: int):
  """The trainer's compiled step for ``model`` with ``attention``, a fresh state and a batch.

  The config is the benchmark's (``python -m vit_jax.benchmark``): ``vit_jax.config`` for
  ImageNet in the pretraining regime, 224 px, 1,000 classes, float32, a 10^6-step schedule;
  the step is ``vit_jax.step``'s, compiled for this host's devices.
  """
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from vit_jax import config as config_lib  # pylint: disable=import-outside-toplevel
  from vit_jax import step  # pylint: disable=import-outside-toplevel
  config = config_lib.get_config(model, 'imagenet2012', attention=attention)
  config.regime = 'pretrain'
  config.batch_size = batch
  config.total_steps = 1_000_000
  config.data.image_size = 224
  config.model.dtype = 'float32'
  config.num_classes = 1000
  config = config_lib.resolve(config, num_train_examples=1_281_167, num_classes=1000,
                              devices=jax.devices())
  setup = step.build(config, image_shape=(224, 224, 3))
  compiled = setup.compile(setup.jit_train_step(), setup.abstract_state,
                           setup.abstract_batch(batch))
  state = jax.jit(setup.init_state, out_shardings=setup.state_shardings)(setup.init_rng)
  keys = jax.random.split(jax.random.key(1))
  data = {'image': jax.random.normal(keys[0], (batch, 224, 224, 3), jnp.float32),
          'labels': jax.nn.one_hot(jax.random.randint(keys[1], (batch,), 0, 1000), 1000)}
  return compiled, state, jax.device_put(data, setup.batch_sharding)


def _step_worker(model: str, batch: int, steps: int) -> dict[str, Any]:
  """Median and minimum seconds of the training step with each attention, alternating.

  Both steps (``attention='xla'`` and ``'cpu_kernel'``, see :func:`_train_step`) are compiled
  in this process, then run in turn, one step each, ``steps`` times after one warm-up each:
  they share the machine's load alike. Also the process CPU seconds per step (all threads).
  """
  import jax  # pylint: disable=import-outside-toplevel
  from vit_jax.kernels import cpu_attention  # pylint: disable=import-outside-toplevel
  runs = {}
  for attention in ('xla', 'cpu_kernel'):
    compiled, state, data = _train_step(model, attention, batch)
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
  result = {k: statistics.median(v) for k, v in times.items()}
  result |= {f'min_{k}': min(v) for k, v in times.items()}
  result['kernel_images_per_sec'] = batch / result['cpu_kernel_s']
  result['xla_images_per_sec'] = batch / result['xla_s']
  return result


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
  """Runs one measurement in this (fresh) process: loads the variant first, if one is given."""
  if spec.get('threads'):  # Before JAX's CPU client exists: it sizes its pool from these.
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:spec['threads']])
    os.environ['NPROC'] = str(spec['threads'])
  from vit_jax.kernels import cpu_attention  # pylint: disable=import-outside-toplevel
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
  out = subprocess.run([sys.executable, '-m', 'vit_jax.tools.measure_attention', '--worker',
                        json.dumps(spec)], capture_output=True, text=True, check=False,
                       env=environ)
  if out.returncode:
    raise RuntimeError(f'measurement {spec} failed:\n{out.stderr[-3000:]}')
  return json.loads(out.stdout.strip().splitlines()[-1])


def runnable_isas() -> list[str]:
  """The variants this CPU can run: the installed library's own and those below it."""
  from vit_jax.kernels import cpu_attention  # pylint: disable=import-outside-toplevel
  best = cpu_attention.isa()
  if best is None:
    raise RuntimeError(f'the kernel is not built: {cpu_attention.library()[1]}')
  return list(cpu_attention.ISAS[cpu_attention.ISAS.index(best):])


def build_variants(isas: Sequence[str], folder: str) -> dict[str, str]:
  """Compiles one library per variant of ``isas`` into ``folder``; returns the paths."""
  from vit_jax.kernels import build  # pylint: disable=import-outside-toplevel
  paths = {}
  for isa in isas:
    paths[isa] = os.path.join(folder, f'cpu_attention_{isa}.so')
    subprocess.run(build.compile_command(paths[isa], isa=isa), check=True,
                   capture_output=True)
  return paths


def measure(isas: Sequence[str], models: Sequence[str], *, core: bool, step: bool, batch: int,
            rounds: int, steps: int, repeats: int, threads: Optional[int] = None
            ) -> dict[str, Any]:
  """Every measurement of the module docstring; the medians over rounds and every round."""
  from vit_jax import platform  # pylint: disable=import-outside-toplevel
  runnable = runnable_isas()
  report: dict[str, Any] = {'cannot_run_here': [i for i in isas if i not in runnable],
                            'rounds': [], 'cpu': _cpu_name(),
                            'threads': threads or len(os.sched_getaffinity(0))}
  isas = [i for i in isas if i in runnable]
  step_environ = platform.huge_pages_environment() or dict(os.environ)
  with tempfile.TemporaryDirectory() as folder:
    libraries = build_variants(isas, folder)
    for r in range(rounds):
      for model in models:
        if core:
          for isa in isas:
            result = _run_worker({'what': 'core', 'library': libraries[isa], 'batch': batch,
                                  'heads': HEADS[model], 'repeats': repeats,
                                  'threads': threads})
            report['rounds'].append(dict(result, round=r, what='core', model=model, isa=isa))
            print(json.dumps(report['rounds'][-1]), flush=True)
        if step:
          for isa in isas:
            spec = {'what': 'step', 'library': libraries[isa], 'model': model, 'batch': batch,
                    'steps': steps, 'threads': threads}
            result = _run_worker(spec, step_environ)
            report['rounds'].append(dict(result, round=r, what='step', model=model, isa=isa))
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


def _cpu_name() -> str:
  try:
    with open('/proc/cpuinfo', encoding='utf-8') as f:
      return next((line.split(':', 1)[1].strip() for line in f
                   if line.startswith('model name')), 'unknown')
  except OSError:
    return 'unknown'


def format_summary(report: dict[str, Any]) -> str:
  """Markdown tables of the medians: the core (ms) and the training step (images/s)."""
  lines = []
  core = [r for r in report['summary'] if r['what'] == 'core']
  if core:
    lines += ['| model | variant | kernel fwd+bwd (ms) | XLA fwd+bwd (ms) | kernel / XLA | '
              'kernel CPU ms | XLA CPU ms | kernel / XLA (CPU) |', '|---' * 8 + '|']
    lines += [f"| {r['model']} | {r['isa']} | {r['kernel_ms']:.1f} | {r['xla_ms']:.1f} | "
              f"{r['kernel_ms'] / r['xla_ms']:.2f} | {r['kernel_cpu_ms']:.1f} | "
              f"{r['xla_cpu_ms']:.1f} | {r['kernel_cpu_ms'] / r['xla_cpu_ms']:.2f} |"
              for r in core]
  step = [r for r in report['summary'] if r['what'] == 'step']
  if step:
    lines += ['', '| model | variant | kernel step (s) | XLA step (s) | kernel / XLA | '
              'kernel CPU s | XLA CPU s | kernel / XLA (CPU) |', '|---' * 8 + '|']
    lines += [f"| {r['model']} | {r['isa']} | {r['cpu_kernel_s']:.2f} | {r['xla_s']:.2f} | "
              f"{r['cpu_kernel_s'] / r['xla_s']:.2f} | {r['cpu_kernel_cpu_s']:.2f} | "
              f"{r['xla_cpu_s']:.2f} | {r['cpu_kernel_cpu_s'] / r['xla_cpu_s']:.2f} |"
              for r in step]
  for isa in report['cannot_run_here']:
    lines.append(f'\n{isa}: this CPU cannot run it (no {isa} instructions); not measured.')
  return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = argparse.ArgumentParser(
      prog='python -m vit_jax.tools.measure_attention', description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  from vit_jax.kernels import cpu_attention  # pylint: disable=import-outside-toplevel
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
  args = parser.parse_args(argv)
  if args.worker:
    print(json.dumps(_worker(json.loads(args.worker))))
    return 0
  if not (args.core or args.step):
    parser.error('say what to measure: --core, --step or both')
  report = measure(args.isa, args.models, core=args.core, step=args.step, batch=args.batch,
                   rounds=args.rounds, steps=args.steps, repeats=args.repeats,
                   threads=args.threads)
  if args.json:
    with open(args.json, 'w', encoding='utf-8') as f:
      json.dump(report, f, indent=1)
  print(format_summary(report))
  return 0


if __name__ == '__main__':
  sys.exit(main())
