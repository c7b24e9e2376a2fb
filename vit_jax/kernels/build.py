"""How vit_jax's kernels are compiled (docs/kernels.md). ``setup.py`` loads this file by its
path (the package's dependencies need not be installed while it builds) and adds
:func:`extensions`; the measuring tool builds one-variant libraries with :func:`compile_command`.
"""

from __future__ import annotations

import importlib.util
import os
from typing import List, Optional

#: The package's folder and the source, relative to the project root (where setup.py is).
PACKAGE_DIR = os.path.join('vit_jax', 'kernels')
CPU_ATTENTION_SOURCE = os.path.join(PACKAGE_DIR, 'cpu_attention.cc')
#: The extension's module name: the library is vit_jax/kernels/_cpu_attention<suffix>.so.
CPU_ATTENTION_MODULE = 'vit_jax.kernels._cpu_attention'
#: Compiler flags (GCC or Clang, C++17). -Wno-psabi: GCC notes ABI changes of vector arguments.
COMPILE_ARGS = ('-std=c++17', '-O3', '-Wno-psabi')
#: Values of the source's VIT_JAX_ISA macro, which builds one variant alone (measurements).
ISA_MACRO = {'baseline': 0, 'avx2': 1, 'avx512': 2}


def ffi_include_dir() -> str:
  """jaxlib's ``include`` folder (``xla/ffi/api/ffi.h``), found without importing jaxlib;
  RuntimeError when jaxlib is missing or ships no FFI headers."""
  spec = importlib.util.find_spec('jaxlib')
  if spec is None or not spec.submodule_search_locations:
    raise RuntimeError('building the CPU attention kernel needs jaxlib (its XLA FFI headers): '
                       '`pip install jaxlib`, or build with build isolation (the default).')
  include = os.path.join(list(spec.submodule_search_locations)[0], 'include')
  if not os.path.isfile(os.path.join(include, 'xla', 'ffi', 'api', 'ffi.h')):
    raise RuntimeError(f'{include} has no xla/ffi/api/ffi.h; install a jaxlib that ships the '
                       'XLA FFI headers (jaxlib >= 0.4.31).')
  return include


def extensions() -> list:
  """The setuptools extensions of the package: the CPU attention kernel, optional."""
  import setuptools  # pylint: disable=import-outside-toplevel
  # optional: without a compiler the install succeeds; the models use XLA's attention.
  return [setuptools.Extension(
      CPU_ATTENTION_MODULE, sources=[CPU_ATTENTION_SOURCE], include_dirs=[ffi_include_dir()],
      language='c++', extra_compile_args=list(COMPILE_ARGS), optional=True)]


def compile_command(output: str, isa: Optional[str] = None, compiler: str = 'g++') -> List[str]:
  """The command that compiles the kernel into ``output``: every variant, or ``isa`` (a key of
  ``ISA_MACRO``) alone, which then runs as that variant on any CPU (SIGILL without its
  instructions). ValueError: an unknown ``isa``."""
  if isa is not None and isa not in ISA_MACRO:
    raise ValueError(f'isa must be one of {sorted(ISA_MACRO)} or None, got {isa!r}')
  source = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'cpu_attention.cc')
  command = [compiler, *COMPILE_ARGS, '-fPIC', '-shared', f'-I{ffi_include_dir()}']
  if isa is not None:
    command.append(f'-DVIT_JAX_ISA={ISA_MACRO[isa]}')
  return command + [source, '-o', output]
