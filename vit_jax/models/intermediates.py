"""What the models compute, read back: every layer's attention weights and output tokens.

The attention modules of :mod:`vit_jax.models.vit` and :mod:`vit_jax.models.t2t` sow their
attention weights, and the encoder / backbone blocks their output tokens, into Flax's
``'intermediates'`` collection (``self.sow``) when, and only when, the caller makes that
collection mutable::

  logits, state = model.apply(variables, images, train=False, mutable=['intermediates'])
  # or capture_intermediates=True, which also records every module's __call__ output

A plain ``apply`` (and ``init``) computes and stores nothing more: the choice is made at trace
time, the traced program is the one without the feature. While capturing, every attention runs
XLA's path whatever the model's ``attention`` field says (the fused CPU kernel and cuDNN do not
return the weights); the logits are the same up to floating-point rounding.

The sown values sit in ``state['intermediates']`` under the module paths (each a 1-tuple, as
``sow`` appends), per-layer or, with ``scan=True``, once with a leading layer axis::

  ViT, hybrids   Transformer/encoderblock_{i}/MultiHeadDotProductAttention_0/attention_weights
                 Transformer/encoderblock_{i}/tokens          (scan: Transformer/encoderblock/..)
                 MAPHead_0/MultiHeadDotProductAttention_0/attention_weights  (classifier 'map')
  T2T-ViT        blocks_{i}/attn/attention_weights, blocks_{i}/tokens       (scan: blocks/..)
                 tokens_to_token/attention{1,2}/attn/attention_weights      (T2T-ViT_t)
                 tokens_to_token/attention{1,2}/attention_weights           (Performer)

This module hides those layouts. :func:`capture` runs the model once (jitted, eval mode) and
returns a :class:`Captured`; :func:`attention_maps`, :func:`tokens` and
:func:`t2t_attention_maps` return one part of it; :func:`unpack` does the reading on a
``state['intermediates']`` the caller got itself (e.g. inside its own jitted step).

Shapes (``B`` images, ``N`` tokens of the encoder / backbone, ``D`` its width):

* ``attention``: one float32 ``[B, heads, N, N]`` per block, in depth order (block 0 first),
  ``softmax(q k^T / sqrt(D / heads))`` before dropout, rows (last axis, the keys) summing to 1.
  ``[b, h, i, j]`` is how much query token ``i`` attends to key token ``j``.
* ``tokens``: each block's output ``[B, N, D]`` in the compute dtype (before the final
  LayerNorm), depth order.
* ``head_attention``: the 'map' head's float32 ``[B, heads, 1, N]`` (its learned probe is the
  single query), else None.
* ``t2t_attention`` (T2T-ViT): the two T2T layers' float32 ``[B, 1, L_s, L_s]`` (one head); with
  the Performer module, the attention matrix its random features imply (rows sum to 1 up to
  the module's 1e-8; :class:`vit_jax.models.t2t.TokenPerformer`), which the model itself never
  forms.

Token order (:class:`TokenLayout`): ``prefix`` leading non-patch tokens (1, the class token, for
ViT with ``classifier='token'`` and for T2T-ViT's backbone; 0 for 'gap' and 'map' ViTs and for
the T2T layers), then the patch tokens of a ``grid = (rows, cols)`` row-major (token
``prefix + r * cols + c``), whose centres are ``stride = (sy, sx)`` input pixels apart: the
patch size for ViT, the ResNet stride times the patch size for hybrids, 16 for T2T-ViT's
backbone and 4 and 8 for its two T2T layers (the soft splits' strides 4, 2, 2; token ``(r, c)``
of T2T-ViT's backbone is centred on pixel ``(16 r + 1, 16 c + 1)``, a ViT patch token on
``(s r + (s-1)/2, ...)``: the offsets cancel in distances).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Mapping
from typing import Any, List, Optional, Tuple

import jax

from vit_jax.models import attention as attention_lib
from vit_jax.models import resnet
from vit_jax.models import t2t
from vit_jax.models import vit

Array = jax.Array

#: The Flax collection, and the names the modules sow under (:mod:`vit_jax.models.attention`).
COLLECTION = attention_lib.INTERMEDIATES
ATTENTION_WEIGHTS = attention_lib.ATTENTION_WEIGHTS
TOKENS = attention_lib.TOKENS


@dataclasses.dataclass(frozen=True)
class TokenLayout:
  """Where the tokens of an attention map come from (see the module docstring).

  Attributes:
    prefix: leading tokens that are not patches (the class token): 1 or 0.
    grid: ``(rows, cols)`` of the patch tokens, which follow row-major.
    stride: ``(sy, sx)``: input pixels between the centres of neighbouring patch tokens.
  """

  prefix: int
  grid: Tuple[int, int]
  stride: Tuple[int, int]

  @property
  def num_tokens(self) -> int:
    """``prefix + rows * cols``: the ``N`` of the maps."""
    return self.prefix + self.grid[0] * self.grid[1]


@dataclasses.dataclass(frozen=True)
class Captured:
  """One forward pass's output and intermediates (shapes in the module docstring).

  Attributes:
    logits: the model's output, float32 ``[B, num_classes]`` (features without a head).
    attention: the encoder / backbone blocks' weights, float32 ``[B, heads, N, N]`` each, block
      0 first.
    tokens: the blocks' outputs ``[B, N, D]``, block 0 first.
    layout: the token order of ``attention`` and ``tokens``.
    head_attention: the 'map' head's float32 ``[B, heads, 1, N]`` (keys: the encoder's tokens,
      ``layout``), or None.
    t2t_attention: T2T-ViT's two T2T layers' float32 ``[B, 1, L, L]``; ``()`` for ViT.
    t2t_layouts: their token orders; ``()`` for ViT.
  """

  logits: Array
  attention: Tuple[Array, ...]
  tokens: Tuple[Array, ...]
  layout: TokenLayout
  head_attention: Optional[Array] = None
  t2t_attention: Tuple[Array, ...] = ()
  t2t_layouts: Tuple[TokenLayout, ...] = ()


def _check_model(model: Any) -> None:
  if not isinstance(model, (vit.VisionTransformer, t2t.T2TViT)):
    raise TypeError(f'Expected a vit_jax VisionTransformer or T2TViT (e.g. from '
                    f'vit_jax.models.create), got {type(model).__name__}.')


def token_layout(model: Any, height: int, width: int) -> TokenLayout:
  """The token order of ``model``'s encoder / backbone for ``height x width`` images.

  Raises:
    TypeError: ``model`` is neither a ViT (hybrids included) nor a T2T-ViT.
    ValueError: an image side the model cannot take (not a multiple of the patch size / total
      stride; too small for T2T-ViT's soft splits).
  """
  _check_model(model)
  if isinstance(model, t2t.T2TViT):
    stride = 1
    for _, step, _ in t2t.SOFT_SPLITS:
      stride *= step
    return TokenLayout(1, t2t.token_grid(height, width), (stride, stride))
  ph, pw = vit.patch_pair(model.patch_size)
  stem = (resnet.resnet_stride(model.resnet_num_layers)
          if model.resnet_num_layers is not None else 1)
  sy, sx = stem * ph, stem * pw
  if height % sy or width % sx:
    raise ValueError(f'Image {height}x{width} is not a multiple of the total patch stride '
                     f'{sy}x{sx} of this model; resize or crop the images.')
  return TokenLayout(1 if model.classifier == 'token' else 0, (height // sy, width // sx),
                     (sy, sx))


def t2t_layouts(model: Any, height: int, width: int) -> Tuple[TokenLayout, ...]:
  """The token orders of T2T-ViT's two T2T layers (their soft splits' grids); ``()`` for ViT.

  Raises as :func:`token_layout`.
  """
  _check_model(model)
  if not isinstance(model, t2t.T2TViT):
    return ()
  layouts, stride = [], 1
  for kernel, step, padding in t2t.SOFT_SPLITS[:2]:
    height = t2t.soft_split_size(height, kernel, step, padding)
    width = t2t.soft_split_size(width, kernel, step, padding)
    stride *= step
    layouts.append(TokenLayout(0, (height, width), (stride, stride)))
  return tuple(layouts)


def _leaf(node: Any, path: Tuple[str, ...]) -> Optional[Array]:
  """The sown value at ``path`` (the last of its tuple), or None if absent."""
  for part in path:
    if not isinstance(node, Mapping) or part not in node:
      return None
    node = node[part]
  return node[-1] if isinstance(node, (tuple, list)) else node


def _per_block(parent: Any, prefix: str, path: Tuple[str, ...], depth: int,
               what: str) -> Tuple[Array, ...]:
  """``depth`` values at ``{prefix}_{i}/path`` (per-layer) or ``{prefix}/path`` (scanned)."""
  parent = parent if isinstance(parent, Mapping) else {}
  stacked = _leaf(parent, (prefix,) + path)
  if stacked is not None:  # nn.scan: one value with a leading layer axis.
    values = tuple(stacked[i] for i in range(stacked.shape[0]))
  else:
    pattern = re.compile(rf'^{re.escape(prefix)}_(\d+)$')
    blocks = sorted((int(m.group(1)), key) for key in parent
                    for m in [pattern.match(str(key))] if m)  # Numeric: _10 after _9.
    values = tuple(v for v in (_leaf(parent[key], path) for _, key in blocks) if v is not None)
  if len(values) != depth:
    raise ValueError(
        f'Found {len(values)} sown {what} for a model of {depth} blocks: the intermediates '
        f"must come from model.apply(variables, images, train=False, mutable=['{COLLECTION}']) "
        f'(or capture_intermediates=True) of this same model.')
  return values


def unpack(model: Any, intermediates: Any) -> dict:
  """Reads a ``state['intermediates']`` tree of ``model`` into depth-ordered lists.

  Works on concrete and traced arrays alike (inside ``jax.jit``), per-layer and scanned.

  Args:
    model: the :class:`~vit_jax.models.vit.VisionTransformer` or
      :class:`~vit_jax.models.t2t.T2TViT` that was applied.
    intermediates: ``state['intermediates']`` of ``model.apply(..., mutable=['intermediates'])``
      (or of ``capture_intermediates=True``).

  Returns:
    ``{'attention': (...), 'tokens': (...), 'head_attention': array or None,
    't2t_attention': (...)}`` as the fields of :class:`Captured`.

  Raises:
    TypeError: another model class.
    ValueError: the tree lacks the sown values (not captured, or from another model).
  """
  _check_model(model)
  if isinstance(model, t2t.T2TViT):
    root, prefix, attn, depth = intermediates, 'blocks', ('attn',), model.depth
  else:
    root = intermediates.get('Transformer') if isinstance(intermediates, Mapping) else None
    prefix, attn, depth = 'encoderblock', ('MultiHeadDotProductAttention_0',), model.num_layers
  out = dict(
      attention=_per_block(root, prefix, attn + (ATTENTION_WEIGHTS,), depth, 'attention weights'),
      tokens=_per_block(root, prefix, (TOKENS,), depth, 'block outputs (tokens)'),
      head_attention=None, t2t_attention=())
  if isinstance(model, vit.VisionTransformer) and model.classifier == 'map':
    out['head_attention'] = _leaf(intermediates, ('MAPHead_0', 'MultiHeadDotProductAttention_0',
                                                  ATTENTION_WEIGHTS))
  if isinstance(model, t2t.T2TViT):
    sub = ('attn',) if model.tokens_type == 'transformer' else ()
    maps = tuple(_leaf(intermediates, ('tokens_to_token', f'attention{i}') + sub
                       + (ATTENTION_WEIGHTS,)) for i in (1, 2))
    if any(m is None for m in maps):
      raise ValueError('The intermediates lack the T2T layers\' attention weights: apply the '
                       f"model with mutable=['{COLLECTION}'].")
    out['t2t_attention'] = maps
  return out


@functools.lru_cache(maxsize=16)
def _forward(model: Any):
  """One compilation per (hashable) model: eval-mode apply with the intermediates mutable."""
  return jax.jit(lambda variables, images: model.apply(variables, images, train=False,
                                                       mutable=[COLLECTION]))


def capture(model: Any, variables: Any, images: Any) -> Captured:
  """Runs ``model`` once (jitted, ``train=False``) and returns its output and intermediates.

  Args:
    model: a :class:`~vit_jax.models.vit.VisionTransformer` (hybrids included, per-layer or
      ``scan=True``) or a :class:`~vit_jax.models.t2t.T2TViT`.
    variables: its variables (boxed or plain; T2T-ViT needs ``'params'`` and ``'constants'``).
    images: ``[B, H, W, C]`` float, preprocessed as for the model's predictions.

  Returns:
    A :class:`Captured` (shapes and token order in the module docstring). Memory: the maps take
    ``4 B heads N^2`` bytes per block; split a large batch.

  Raises:
    TypeError: another model class.
    ValueError: images not ``[B, H, W, C]`` or of a size the model cannot take, or variables
      that do not fit the model (the model's own messages).
  """
  _check_model(model)
  if getattr(images, 'ndim', None) != 4:
    raise ValueError(f'images must be [batch, height, width, channels] (NHWC), got shape '
                     f'{getattr(images, "shape", type(images).__name__)}.')
  height, width = int(images.shape[1]), int(images.shape[2])
  logits, state = _forward(model)(variables, images)
  parts = unpack(model, state[COLLECTION])
  return Captured(logits=logits, layout=token_layout(model, height, width),
                  t2t_layouts=t2t_layouts(model, height, width), **parts)


def attention_maps(model: Any, variables: Any, images: Any) -> List[Array]:
  """The encoder / backbone blocks' attention weights, float32 ``[B, heads, N, N]`` each, block 0
  first (:func:`capture`'s ``attention``). Raises as :func:`capture`."""
  return list(capture(model, variables, images).attention)


def tokens(model: Any, variables: Any, images: Any) -> List[Array]:
  """The encoder / backbone blocks' outputs ``[B, N, D]``, block 0 first (:func:`capture`'s
  ``tokens``). Raises as :func:`capture`."""
  return list(capture(model, variables, images).tokens)


def t2t_attention_maps(model: Any, variables: Any, images: Any) -> List[Array]:
  """T2T-ViT's two T2T layers' attention weights, float32 ``[B, 1, L, L]`` (:func:`capture`'s
  ``t2t_attention``).

  Raises:
    TypeError: ``model`` is not a T2T-ViT; otherwise as :func:`capture`.
  """
  if not isinstance(model, t2t.T2TViT):
    raise TypeError(f'T2T-module attention exists for T2TViT models only, got '
                    f'{type(model).__name__}; use attention_maps for the encoder.')
  return list(capture(model, variables, images).t2t_attention)
