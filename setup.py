"""Builds vit_jax's one compiled part, the XLA:CPU fused attention kernel (everything else is
in pyproject.toml).

What is built and how is defined beside the kernel, in `vit_jax/kernels/build.py`; it is
loaded here by its file path, without importing the `vit_jax` package (whose dependencies, jax
among them, need not be importable while the package is being built).
"""

import importlib.util
import os

import setuptools


def _kernels_build():
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'vit_jax', 'kernels',
                      'build.py')
  spec = importlib.util.spec_from_file_location('_vit_jax_kernels_build', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


setuptools.setup(ext_modules=_kernels_build().extensions())
