"""Builds vit_jax's one compiled part, the XLA:CPU fused attention kernel (everything else is
in pyproject.toml).

`vit_jax/csrc/fused_attention.cc` becomes `vit_jax/_fused_attention*.so`, a plain shared library
that `vit_jax.models.fused_attention` loads with ctypes and registers as two XLA FFI targets.
It compiles against the XLA FFI headers that jaxlib ships (a build requirement), takes about
25 s, and is optional: without a C++17 compiler the install still succeeds and the models use
XLA's attention (`vit_jax.models.fused_attention.status()` says why).
"""

import os

import setuptools


def _ffi_include_dir() -> str:
  import jaxlib  # pylint: disable=import-outside-toplevel
  return os.path.join(os.path.dirname(jaxlib.__file__), 'include')


setuptools.setup(ext_modules=[
    setuptools.Extension(
        'vit_jax._fused_attention',
        sources=['vit_jax/csrc/fused_attention.cc'],
        include_dirs=[_ffi_include_dir()],
        language='c++',
        extra_compile_args=['-std=c++17', '-O3', '-Wno-psabi'],
        optional=True,
    ),
])
