"""The official T2T-ViT constructor arguments recorded with the golden fixtures."""

import ast
import functools
import json
import pathlib

FIXTURES = pathlib.Path(__file__).parent / 'fixtures'


def _eval_constant(node):
  """Evaluates numbers and ``a ** b`` / unary minus in the recorded constructor call."""
  if isinstance(node, ast.Constant):
    return node.value
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
    return -_eval_constant(node.operand)
  if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
    return _eval_constant(node.left) ** _eval_constant(node.right)
  raise ValueError(f'Unsupported constructor argument {ast.dump(node)}')


@functools.lru_cache(maxsize=None)
def constructor_kwargs(name: str) -> dict:
  """kwargs of the official `T2T_ViT(...)` call in `fixtures/<name>/config.json`.

  E.g. `{'img_size': 64, 'num_classes': 10, 'qk_scale': 64 ** -0.5, ...}`; parsed with `ast`,
  never evaluated as code.
  """
  constructor = json.loads((FIXTURES / name / 'config.json').read_text())['constructor']
  call = ast.parse(constructor, mode='eval').body
  return {kw.arg: _eval_constant(kw.value) for kw in call.keywords}
