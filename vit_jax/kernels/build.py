"""How vit_jax's kernels are compiled: the setuptools extension, the FFI headers and the flags.

The top-level ``setup.py`` loads this file by its path (it must not import the ``vit_jax``
package, whose dependencies need not be installed while the package is being built) and adds
:func:`extensions` to the build. ``vit_jax/tools/measure_attention.py`` uses :func:`compile_command` to build variants
restricted to one instruction set.

``cpu_attention.cc`` becomes ``vit_jax/kernels/_cpu_attention*.so``, a plain shared library that
``cpu_attention.py`` loads with ctypes and registers as two XLA FFI targets. It compiles against
the XLA FFI headers that jaxlib ships under ``jaxlib/include`` (jaxlib is a build requirement),
takes about 30 s, and is optional: without a C++17 compiler the install still succeeds and
``cpu_attention.library()`` says why the kernel is missing.
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
  """jaxlib's ``include`` folder, which holds ``xla/ffi/api/ffi.h``; found without importing.

  Raises:
    RuntimeError: jaxlib is not installed, or ships no FFI headers.
  """
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
  return [setuptools.Extension(
      CPU_ATTENTION_MODULE,
      sources=[CPU_ATTENTION_SOURCE],
      include_dirs=[ffi_include_dir()],
      language='c++',
      extra_compile_args=list(COMPILE_ARGS),
      optional=True,  # Without a compiler the install succeeds; the models use XLA's attention.
  )]


def compile_command(output: str, isa: Optional[str] = None, compiler: str = 'g++') -> List[str]:
  """The command that compiles ``cpu_attention.cc`` into the shared library ``output``.

  Args:
    output: path of the ``.so`` to write.
    isa: one of ``ISA_MACRO``'s keys to build that variant alone (it then runs on any CPU
      as that variant, and crashes with SIGILL on one without its instructions); None builds
      all of them, chosen at load time, like the installed library.
    compiler: the C++ compiler to run.

  Raises:
    ValueError: an unknown ``isa``.
  """
  if isa is not None and isa not in ISA_MACRO:
    raise ValueError(f'isa must be one of {sorted(ISA_MACRO)} or None, got {isa!r}')
  source = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'cpu_attention.cc')
  command = [compiler, *COMPILE_ARGS, '-fPIC', '-shared', f'-I{ffi_include_dir()}']
  if isa is not None:
    command.append(f'-DVIT_JAX_ISA={ISA_MACRO[isa]}')
  return command + [source, '-o', output]
