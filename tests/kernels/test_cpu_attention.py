"""The fused CPU attention kernel (vit_jax/kernels/cpu_attention.*) against XLA's attention."""

import functools
import json
import os
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vit_jax import models
from vit_jax.kernels import build
from vit_jax.kernels import cpu_attention
from vit_jax.models import attention

KERNELS_DIR = os.path.dirname(cpu_attention.__file__)
ROOT = os.path.dirname(os.path.dirname(KERNELS_DIR))


def _reference(qkv, scale):
  """XLA's core on the [B, heads, N, Dh] transposes, moved back to [B, N, heads, Dh]."""
  q, k, v = jnp.transpose(qkv, (2, 0, 3, 1, 4))
  return jnp.swapaxes(attention.dot_product_attention(q, k, v, logits_scale=scale), 1, 2)


def _qkv(shape, seed=0, magnitude=1.0):
  return magnitude * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _cpu_flags():
  with open('/proc/cpuinfo', encoding='utf-8') as f:
    for line in f:
      if line.startswith('flags'):
        return set(line.split(':', 1)[1].split())
  return set()


def test_the_kernel_was_built_where_a_compiler_is():
  path, reason = cpu_attention.library()
  if shutil.which('g++') or shutil.which('c++'):
    assert path is not None, reason
    assert os.path.dirname(path) == KERNELS_DIR
    assert re.fullmatch(r'_cpu_attention.*\.so', os.path.basename(path))
  else:  # Without a compiler the install skips the extension and says how to get it.
    assert path is None and 'g++' in reason


needs_kernel = pytest.mark.skipif(cpu_attention.library()[0] is None,
                                  reason='the fused attention kernel was not built')
needs_x86_linux = pytest.mark.skipif(not os.path.exists('/proc/cpuinfo')
                                     or 'x86_64' not in os.uname().machine,
                                     reason='reads the x86-64 flags of /proc/cpuinfo')


@needs_kernel
@needs_x86_linux
def test_the_variant_that_runs_is_the_best_one_the_cpu_has():
  """The x86-64 levels of GCC's target_clones: v4 needs AVX-512 F/BW/CD/DQ/VL, v3 AVX2 etc."""
  flags = _cpu_flags()
  v4 = {'avx512f', 'avx512bw', 'avx512cd', 'avx512dq', 'avx512vl'}
  v3 = {'avx', 'avx2', 'bmi1', 'bmi2', 'f16c', 'fma', 'movbe', 'xsave', 'abm'}
  expected = 'avx512' if v4 | v3 <= flags else 'avx2' if v3 <= flags else 'baseline'
  assert cpu_attention.isa() == expected
  assert cpu_attention.isa() in cpu_attention.ISAS


@needs_kernel
def test_faster_than_xla_is_the_measured_decision_for_the_variant():
  faster, reason = cpu_attention.faster_than_xla()
  assert isinstance(faster, bool)
  assert (faster, cpu_attention.isa()) == (cpu_attention.MEASURED[cpu_attention.isa()][0],
                                           cpu_attention.isa())
  assert reason.startswith(f'its {cpu_attention.isa()} variant runs on this CPU; ')
  assert 'docs/kernels.md' in reason
  assert cpu_attention.status().startswith(f'available, {cpu_attention.isa()} variant (')


def test_every_variant_has_a_measured_decision():
  assert set(cpu_attention.MEASURED) == set(cpu_attention.ISAS)
  for faster, reason in cpu_attention.MEASURED.values():
    assert isinstance(faster, bool) and 'docs/kernels.md' in reason
  # The automatic choice never picks the kernel where it was measured slower than XLA.
  assert not cpu_attention.MEASURED['baseline'][0]


def test_faster_than_xla_says_no_without_the_library(monkeypatch):
  monkeypatch.setattr(cpu_attention, 'library', lambda: (None, 'not built (test)'))
  assert cpu_attention.faster_than_xla() == (
      False, 'the kernel is not available: not built (test)')
  assert cpu_attention.isa() is None
  assert cpu_attention.status() == 'unavailable: not built (test)'


def test_supports_is_a_pure_predicate_of_shape_and_dtype():
  assert cpu_attention.supports((2, 197, 3, 3, 64), jnp.float32)
  assert cpu_attention.supports((1, 1, 3, 1, 16), 'float32')
  assert not cpu_attention.supports((2, 197, 3, 3, 64), jnp.bfloat16)
  assert not cpu_attention.supports((2, 197, 3, 3, 24), jnp.float32)  # Dh not a multiple of 16.
  assert not cpu_attention.supports((2, 197, 2, 3, 64), jnp.float32)  # Not q, k and v.
  assert not cpu_attention.supports((197, 3, 3, 64), jnp.float32)  # Rank 4.


@needs_kernel
@pytest.mark.parametrize('shape,scale,magnitude,rtol', [
    ((2, 13, 3, 2, 16), 0.25, 1.0, 1e-5),   # N below one 16-lane vector, 2 heads.
    ((3, 16, 3, 1, 32), 1.0, 1.0, 1e-5),    # N exactly one vector, one head.
    ((2, 50, 3, 3, 64), 0.125, 1.0, 1e-5),  # ViT-Ti's head size, N with a tail of 2.
    ((1, 1, 3, 2, 16), 0.5, 1.0, 1e-5),     # A single token: the weights are exactly 1.
    ((1, 23, 3, 1, 48), 0.3, 1.0, 1e-5),    # Dh of three 16-lane vectors (AVX-512 tile tail).
    # Logits of magnitude ~1e4, which overflow exp unless the row maximum is taken out; their
    # own float32 rounding (ulp ~1e-3) then bounds the agreement of any two implementations.
    ((2, 37, 3, 2, 16), 1.0, 30.0, 1e-3),
])
def test_forward_and_gradients_equal_xla(shape, scale, magnitude, rtol):
  qkv = _qkv(shape, magnitude=magnitude)
  cotangent = _qkv((shape[0], shape[1], shape[3], shape[4]), seed=1)
  ours = jax.jit(lambda a: cpu_attention.attention(a, logits_scale=scale))(qkv)
  theirs = _reference(qkv, scale)
  assert np.all(np.isfinite(ours))
  np.testing.assert_allclose(ours, theirs, atol=rtol * float(jnp.max(jnp.abs(theirs))))

  def loss(fn, a):
    return jnp.sum(fn(a) * cotangent)

  grad_ours = jax.jit(jax.grad(functools.partial(
      loss, lambda a: cpu_attention.attention(a, logits_scale=scale))))(qkv)
  grad_theirs = jax.jit(jax.grad(functools.partial(
      loss, lambda a: _reference(a, scale))))(qkv)
  np.testing.assert_allclose(grad_ours, grad_theirs,
                             atol=rtol * float(jnp.max(jnp.abs(grad_theirs))))


@needs_kernel
def test_many_items_over_the_thread_pool_and_vmap():
  qkv = _qkv((8, 197, 3, 3, 64))  # 24 (image, head) items at ViT's 197 tokens.
  ours = jax.jit(lambda a: cpu_attention.attention(a, logits_scale=0.125))(qkv)
  np.testing.assert_allclose(ours, _reference(qkv, 0.125), atol=2e-6)
  stacked = qkv.reshape(2, 4, *qkv.shape[1:])
  mapped = jax.vmap(lambda a: cpu_attention.attention(a, logits_scale=0.125))(stacked)
  np.testing.assert_allclose(mapped.reshape(ours.shape), ours, atol=1e-7)


@needs_kernel
def test_bad_input_is_refused_with_the_reason():
  with pytest.raises(ValueError, match=r'\[B, N, 3, heads, Dh\]'):
    cpu_attention.attention(jnp.zeros((2, 5, 2, 16)), logits_scale=1.0)
  with pytest.raises(ValueError, match='divisible by 16'):
    cpu_attention.attention(jnp.zeros((2, 5, 3, 1, 24)), logits_scale=1.0)
  with pytest.raises(ValueError, match='float32'):
    cpu_attention.attention(jnp.zeros((2, 5, 3, 1, 16), jnp.bfloat16), logits_scale=1.0)


def test_macs_count_the_products():
  shape = (2, 197, 3, 3, 64)
  assert cpu_attention.macs(cpu_attention.FORWARD_TARGET, shape) == 2 * 2 * 3 * 197**2 * 64
  assert cpu_attention.macs(cpu_attention.BACKWARD_TARGET, shape) == 5 * 2 * 3 * 197**2 * 64


def _kernel_calls(policy):
  """How often the compiled training gradient runs the kernel's forward and backward."""
  model = models.create('ViT-custom', num_classes=5, hidden_size=64, mlp_dim=128, num_heads=2,
                        num_layers=2, patch_size=8, attention='cpu_kernel', scan=True,
                        remat=True, remat_policy=policy)
  images = jnp.ones((2, 32, 32, 3))
  params = models.unbox(model.init(jax.random.key(0), images, train=False))['params']

  def loss(p):
    return jnp.sum(model.apply({'params': p}, images, train=True))

  compiled = jax.jit(jax.grad(loss)).lower(params).compile()
  assert cpu_attention.called_by(compiled)
  text = compiled.as_text()
  return tuple(len(re.findall(f'custom_call_target="{target}"', text))
               for target in cpu_attention.TARGETS)


@needs_kernel
@pytest.mark.slow
def test_the_saved_residuals_spare_the_backward_a_second_forward():
  """RESIDUAL_NAMES saved by the policy: the forward runs once; without them, again."""
  assert _kernel_calls('dots_and_attention_saveable') == (1, 1)  # Forward once, in the scan.
  assert _kernel_calls('dots_with_no_batch_dims_saveable') == (2, 1)  # Run again by the remat.


def test_setup_loads_the_build_without_importing_vit_jax_or_jax():
  """setup.py runs where jax is not importable: build.py must need only setuptools (and find
  jaxlib's headers without importing it)."""
  build_py = os.path.join(KERNELS_DIR, 'build.py')
  code = ('import importlib.util, sys\n'
          f'spec = importlib.util.spec_from_file_location("b", {build_py!r})\n'
          'm = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n'
          '(ext,) = m.extensions()\n'
          'print(ext.name, ext.sources, sorted(k for k in sys.modules if k.split(".")[0] in '
          '("vit_jax", "jax", "jaxlib")))\n')
  out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                       check=True)
  assert out.stdout.split() == ['vit_jax.kernels._cpu_attention',
                                "['vit_jax/kernels/cpu_attention.cc']", '[]']
  with open(os.path.join(ROOT, 'setup.py'), encoding='utf-8') as f:
    assert 'spec_from_file_location' in f.read()


def test_compile_command_restricts_the_build_to_one_variant():
  command = build.compile_command('/tmp/x.so', isa='avx2')
  assert command[0] == 'g++' and '-DVIT_JAX_ISA=1' in command
  assert command[-3:] == [os.path.join(KERNELS_DIR, 'cpu_attention.cc'), '-o', '/tmp/x.so']
  assert not any(c.startswith('-DVIT_JAX_ISA') for c in build.compile_command('/tmp/x.so'))
  with pytest.raises(ValueError, match="isa must be one of"):
    build.compile_command('/tmp/x.so', isa='sse9')


@needs_kernel
@pytest.mark.slow
@pytest.mark.skipif(not shutil.which('g++'), reason='needs g++')
def test_a_build_of_the_baseline_variant_alone_computes_the_same(tmp_path):
  """The measurement builds (VIT_JAX_ISA) load in place of the installed library and agree."""
  library = str(tmp_path / 'baseline.so')
  subprocess.run(build.compile_command(library, isa='baseline'), check=True,
                 capture_output=True)
  code = ('import json, sys, numpy as np, jax\n'
          'from vit_jax.kernels import cpu_attention as c\n'
          f'print(c.load({library!r}))\n'
          'qkv = jax.random.normal(jax.random.key(0), (2, 50, 3, 3, 64))\n'
          'out = c.attention(qkv, logits_scale=0.125)\n'
          'grad = jax.grad(lambda a: c.attention(a, logits_scale=0.125).sum())(qkv)\n'
          'np.save(sys.argv[1], np.concatenate([np.ravel(out), np.ravel(grad)]))\n'
          'print(json.dumps([c.isa(), c.library()[0]]))\n')
  result = str(tmp_path / 'result.npy')
  out = subprocess.run([sys.executable, '-c', code, result], cwd=ROOT, capture_output=True,
                       text=True, check=True)
  assert json.loads(out.stdout.splitlines()[-1]) == ['baseline', library]
  qkv = jax.random.normal(jax.random.key(0), (2, 50, 3, 3, 64))
  expected = np.concatenate([
      np.ravel(cpu_attention.attention(qkv, logits_scale=0.125)),
      np.ravel(jax.grad(lambda a: cpu_attention.attention(a, logits_scale=0.125).sum())(qkv))])
  np.testing.assert_allclose(np.load(result), expected, atol=2e-5)

