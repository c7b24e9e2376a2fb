"""The import graph of the vit_jax package, read statically (ast; nothing is imported).

Every ``import``/``from ... import`` of every module counts, also those inside functions (a lazy
import is still a dependency). ``from package import name`` depends on the submodule
``package.name`` when there is one, else on the package itself; the implicit import of parent
packages is not an edge (Python runs ``package/__init__.py`` first, which is not a cycle).
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = 'vit_jax'
#: The command-line tools: library modules must not import them.
TOOLS = ('vit_jax.benchmark', 'vit_jax.cost', 'vit_jax.convert', 'vit_jax.preflight',
         'vit_jax.tools', 'vit_jax.main', 'vit_jax.predict', 'vit_jax.evaluate',
         'vit_jax.fewshot', 'vit_jax.analyze', 'vit_jax.to_array_record')
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


def test_checkpoint_code_lives_in_checkpoint(graph):
  """File formats and their name mappings are vit_jax.checkpoint's; models/ is pure Flax."""
  moved = ('t2t_torch', 'vit_shapes', 'mismatch')
  assert not [m for m in moved if f'vit_jax.models.{m}' in graph]
  assert all(f'vit_jax.checkpoint.{m}' in graph for m in moved)
