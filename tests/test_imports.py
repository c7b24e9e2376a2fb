"""The import graph of the vit_jax package, read statically (ast; nothing is imported).

Every ``import``/``from ... import`` of every module counts, also those inside functions (a lazy
import is still a dependency). ``from package import name`` depends on the submodule
``package.name`` when there is one, else on the package itself; the implicit import of parent
packages is not an edge (Python runs ``package/__init__.py`` first, which is not a cycle).
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = 'vit_jax'
#: The command-line tools: library modules must not import them.
TOOLS = ('vit_jax.cost', 'vit_jax.convert', 'vit_jax.preflight', 'vit_jax.tools', 'vit_jax.main',
         'vit_jax.predict', 'vit_jax.evaluate', 'vit_jax.fewshot', 'vit_jax.analyze',
         'vit_jax.to_array_record', 'vit_jax.export')
#: The repository's development tools outside the package (not installed with it): nothing of
#: the package may import them.
OUTSIDE = ('benchmarks',)
#: What the models package may import from vit_jax besides itself.
MODELS_MAY_IMPORT = ('vit_jax.models', 'vit_jax.kernels')


def _modules():
  """{dotted module name: path} of every module of the package (packages by their __init__)."""
  modules = {}
  for path in sorted((ROOT / PACKAGE).rglob('*.py')):
    parts = path.relative_to(ROOT).with_suffix('').parts
    if any(p.startswith('.') or p == '__pycache__' for p in parts):
      continue
    if parts[-1] == '__init__':
      parts = parts[:-1]
    modules['.'.join(parts)] = path
  return modules


def _within(name, prefixes):
  return any(name == p or name.startswith(p + '.') for p in prefixes)


def _imports(name, path, modules):
  """The modules of the package that module ``name`` imports (anywhere in its code)."""
  is_package = path.name == '__init__.py'
  found = set()

  def add(target):
    while target and target not in modules:  # 'vit_jax.models.vit.X' -> 'vit_jax.models.vit'.
      target = target.rpartition('.')[0]
    if target and target != name:
      found.add(target)

  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if _within(alias.name, (PACKAGE,)):
          add(alias.name)
    elif isinstance(node, ast.ImportFrom):
      if node.level:  # Relative: from the package (of this module) upwards.
        base = name.split('.') if is_package else name.split('.')[:-1]
        base = base[:len(base) - node.level + 1]
        source = '.'.join(base + ([node.module] if node.module else []))
      else:
        source = node.module or ''
      if not _within(source, (PACKAGE,)):
        continue
      for alias in node.names:
        submodule = f'{source}.{alias.name}'
        add(submodule if submodule in modules else source)
  return found


@pytest.fixture(scope='module')
def graph():
  modules = _modules()
  assert f'{PACKAGE}.checkpoint.workdir' in modules and f'{PACKAGE}.models.vit' in modules
  return {name: _imports(name, path, modules) for name, path in modules.items()}


def _cycle(graph):
  """One import cycle as a list of modules (first == last), or None."""
  state, stack = {}, []

  def visit(node):
    state[node] = 'open'
    stack.append(node)
    for target in sorted(graph.get(node, ())):
      if state.get(target) == 'open':
        return stack[stack.index(target):] + [target]
      if target not in state:
        found = visit(target)
        if found:
          return found
    stack.pop()
    state[node] = 'done'
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


def test_the_graph_sees_lazy_and_relative_imports(graph):
  assert 'vit_jax.models.t2t' in graph['vit_jax.checkpoint.t2t_torch']
  assert 'vit_jax.checkpoint.workdir' in graph['vit_jax.checkpoint']
  assert 'vit_jax.models' in graph['vit_jax.checkpoint.formats']  # 'from vit_jax import models'.


def test_no_import_cycles(graph):
  cycle = _cycle(graph)
  assert cycle is None, 'import cycle: ' + ' -> '.join(cycle)


def test_models_import_only_models_and_kernels(graph):
  bad = {name: sorted(t for t in targets if not _within(t, MODELS_MAY_IMPORT))
         for name, targets in graph.items() if _within(name, ('vit_jax.models',))}
  assert not {k: v for k, v in bad.items() if v}


def test_library_modules_do_not_import_the_tools(graph):
  bad = {name: sorted(t for t in targets if _within(t, TOOLS))
         for name, targets in graph.items() if not _within(name, TOOLS)}
  assert not {k: v for k, v in bad.items() if v}


def _outside_imports(source):
  """``[(line, module)]``: each import of a module of OUTSIDE in the module text ``source``
  (anywhere in its code; relative imports stay inside the package)."""
  found = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and not node.level:
      names = [node.module or '']
    else:
      continue
    found += [(node.lineno, n) for n in names if _within(n, OUTSIDE)]
  return sorted(found)


def test_the_outside_check_finds_every_form_of_import():
  source = """import benchmarks
from benchmarks import ours
def f():
  import benchmarks.runner as runner
  from benchmarks.common import BenchmarkError
from . import benchmarks
import benchmarks_extra
"""
  assert _outside_imports(source) == [(1, 'benchmarks'), (2, 'benchmarks'),
                                      (4, 'benchmarks.runner'), (5, 'benchmarks.common')]


def test_the_package_never_imports_the_benchmarks():
  """benchmarks/ (`python -m benchmarks`) is a development tool of the repository, not installed
  with the package: a package module that imported it would fail after `pip install .`."""
  assert (ROOT / 'benchmarks' / '__init__.py').exists()
  found = [f'{path.relative_to(ROOT)}:{line}: imports {module}'
           for path in _modules().values() for line, module in _outside_imports(path.read_text())]
  assert not found, '\n'.join(found)


def test_checkpoint_code_lives_in_checkpoint(graph):
  """File formats and their name mappings are vit_jax.checkpoint's; models/ is pure Flax."""
  moved = ('t2t_torch', 'vit_shapes', 'mismatch')
  assert not [m for m in moved if f'vit_jax.models.{m}' in graph]
  assert all(f'vit_jax.checkpoint.{m}' in graph for m in moved)


#: The module that owns paths, the file API and storage errors (vit_jax/storage.py).
STORAGE = f'{PACKAGE}.storage'
#: What to use instead of a ``tf.io.gfile`` function.
_GFILE_INSTEAD = {'GFile': 'open_file', 'stat': 'size', 'exists': 'exists', 'isdir': 'isdir',
                  'listdir': 'listdir', 'walk': 'walk', 'glob': 'glob', 'makedirs': 'makedirs',
                  'copy': 'copy', 'rename': 'rename', 'remove': 'remove'}


def _docstrings(tree):
  """The ids of the docstring nodes of ``tree`` (module, classes, functions)."""
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      body = node.body
      if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        found.add(id(body[0].value))
  return found


def _storage_uses(source):
  """``[(line, what, instead)]``: each use of a file-system library (``tf.io.gfile``,
  ``etils.epath``) or check of a path's scheme (a ``'://'`` or ``'gs://'`` literal in code, not
  in a message or docstring) in the module text ``source``."""
  tree = ast.parse(source)
  skipped = _docstrings(tree)
  for node in ast.walk(tree):
    if isinstance(node, ast.JoinedStr):  # An f-string's parts are message text.
      skipped.update(id(part) for part in ast.walk(node))
  called = {id(node.value) for node in ast.walk(tree)  # The `tf.io.gfile` of `tf.io.gfile.X`.
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == 'gfile'}
  found = []
  for node in ast.walk(tree):
    what = instead = None
    if id(node) in called:
      continue
    if isinstance(node, ast.Attribute) and id(node.value) in called:
      what = f'gfile.{node.attr}'
      instead = f'storage.{_GFILE_INSTEAD.get(node.attr, "open_file")}'
    elif isinstance(node, ast.Attribute) and node.attr == 'gfile':
      what, instead = 'tf.io.gfile', 'the file functions of storage'
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      names = [getattr(node, 'module', None) or ''] + [a.name for a in node.names]
      if any(n == 'epath' or n.endswith('.epath') for n in names):
        what, instead = 'etils.epath', 'storage.Path or the file functions of storage'
      elif any(n == 'gfile' or n.endswith('.gfile') for n in names):
        what, instead = 'tf.io.gfile', 'the file functions of storage'
    elif isinstance(node, ast.Name) and node.id in ('gfile', 'epath'):
      what, instead = node.id, 'storage.Path or the file functions of storage'
    elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
          and id(node) not in skipped and re.fullmatch(r'([a-z][a-z0-9+.-]*)?://', node.value)):
      what, instead = f'a scheme check ({node.value!r})', 'storage.is_remote or storage.scheme'
    if what:
      found.append((node.lineno, what, instead))
  return sorted(set(found))


def test_the_storage_check_finds_file_apis_and_scheme_checks_but_not_messages():
  source = '''"""A docstring about gs:// and '://'."""
import tensorflow as tf
from etils import epath
def f(path):
  """gs://bucket."""
  message = f'give gs://BUCKET/PATH ({path}://)'
  if '://' in path or path.startswith(('gs://', 'file://')):
    return tf.io.gfile.GFile(path), epath.Path(path), message
'''
  assert _storage_uses(source) == [
      (3, 'etils.epath', 'storage.Path or the file functions of storage'),
      (7, "a scheme check ('://')", 'storage.is_remote or storage.scheme'),
      (7, "a scheme check ('file://')", 'storage.is_remote or storage.scheme'),
      (7, "a scheme check ('gs://')", 'storage.is_remote or storage.scheme'),
      (8, 'epath', 'storage.Path or the file functions of storage'),
      (8, 'gfile.GFile', 'storage.open_file')]


def test_only_the_storage_module_uses_a_file_api_or_checks_a_scheme():
  """tf.io.gfile, etils.epath and scheme checks live in vit_jax/storage.py only (issue 51: a
  path whose scheme a module judged itself was written with os.path under './gs:/')."""
  modules = _modules()
  assert STORAGE in modules and _storage_uses(modules[STORAGE].read_text())
  found = [f'{path.relative_to(ROOT)}:{line}: {what}; use {instead} (vit_jax/storage.py) instead'
           for name, path in modules.items() if name != STORAGE
           for line, what, instead in _storage_uses(path.read_text())]
  assert not found, '\n'.join(found)
