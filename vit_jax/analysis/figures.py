"""The analysis figures (the ViT paper's Fig. 6, 7 and 14), matplotlib on the Agg canvas (no
pyplot): each ``*_figure`` returns a Figure of inches x ``dpi`` pixels, its namesake without the
suffix writes a PNG; :func:`to_rgb` renders one to uint8 ``[H, W, 3]``. Images are
``[B, H, W(, C)]``, C 1 or 3.
"""

from __future__ import annotations

import io
import math
from typing import Any, Callable, Optional, Sequence, Tuple

from matplotlib import colormaps
from matplotlib import figure as mpl_figure
from matplotlib.backends import backend_agg
import numpy as np

from vit_jax import storage
from vit_jax.analysis import attention_maps

#: Resolution of the figures (pixels per inch).
DPI = 100
#: Side of one image panel, inches.
PANEL = 2.0
#: Height of the band for the figure title, inches.
TITLE_BAND = 0.5
#: Styles of :func:`overlay`: a colour map blended over the image, or the image times the map.
OVERLAY_STYLES = ('heatmap', 'mask')


def _new_figure(width: float, height: float, dpi: int) -> mpl_figure.Figure:
  fig = mpl_figure.Figure(figsize=(width, height), dpi=dpi)
  backend_agg.FigureCanvasAgg(fig)
  return fig


def write_png(fig: mpl_figure.Figure, path: str) -> str:
  """Writes ``fig`` to ``path`` (local or gs://) as a PNG, its parent folders created; returns
  ``path``."""
  png = io.BytesIO()
  fig.savefig(png, format='png', dpi=fig.dpi)
  storage.write_bytes(path, png.getvalue())
  return path


def to_rgb(fig: mpl_figure.Figure) -> np.ndarray:
  """``fig`` rendered on its Agg canvas: ``[H, W, 3]`` uint8, ``H, W`` = size in inches x dpi."""
  canvas = fig.canvas
  if not isinstance(canvas, backend_agg.FigureCanvasAgg):
    canvas = backend_agg.FigureCanvasAgg(fig)
  canvas.draw()
  return np.array(canvas.buffer_rgba())[..., :3]


def prediction_caption(predicted: str, true: Optional[str] = None) -> str:
  """'Pullover (true Coat)', or just the prediction when it is right or the truth unknown."""
  return predicted if true is None or true == predicted else f'{predicted} (true {true})'


def display_images(images: Any) -> np.ndarray:
  """``[B, H, W(, 1 or 3)]`` -> ``[B, H, W, 3]`` float in [0, 1]: uint8 / 255, floats scaled per
  image from min to max (constant: 0.5)."""
  images = np.asarray(images)
  if images.ndim == 3:
    images = images[..., None]
  if images.ndim != 4 or images.shape[-1] not in (1, 3):
    raise ValueError(f'images must have shape [B, H, W] or [B, H, W, C] with C 1 (grayscale) or '
                     f'3 (RGB), got {images.shape}')
  if images.dtype == np.uint8:
    out = images.astype(np.float32) / 255.0
  else:
    out = images.astype(np.float32)
    attention_maps.check_finite(out, 'images')
    out = _stretch(out, (1, 2, 3))
  return np.repeat(out, 3, axis=-1) if out.shape[-1] == 1 else out


def overlay(images: Any, maps: Any, *, alpha: float = 0.5, cmap: str = 'jet',
            style: str = 'heatmap') -> np.ndarray:
  """Token maps ``[B, gh, gw]`` in [0, 1] upsampled over the images: ``[B, H, W, 3]`` float32,
  'heatmap' ``(1 - alpha) image + alpha cmap(map)`` or 'mask' ``image * map``."""
  if style not in OVERLAY_STYLES:
    raise ValueError(f'style must be one of {OVERLAY_STYLES}, got {style!r}')
  if not 0.0 <= alpha <= 1.0:
    raise ValueError(f'alpha must be in [0, 1], got {alpha!r}')
  shown = display_images(images)
  maps = np.asarray(maps, dtype=np.float32)
  if maps.ndim != 3 or maps.shape[0] != shown.shape[0]:
    raise ValueError(f'maps must have shape [B, gh, gw] with B = {shown.shape[0]} images, got '
                     f'{maps.shape}')
  attention_maps.check_finite(maps, 'maps')
  big = np.clip(attention_maps.upsample(maps, shown.shape[1:3]), 0.0, 1.0)
  if style == 'mask':
    return shown * big[..., None]
  colours = colormaps[cmap](big)[..., :3].astype(np.float32)
  return (1.0 - alpha) * shown + alpha * colours


def _panel(ax, picture: np.ndarray, title: Optional[str], **kwargs) -> None:
  ax.imshow(picture, interpolation='nearest', **kwargs)
  ax.set_axis_off()
  if title:
    ax.set_title(title, fontsize=8)


def _item_grid(count: int, columns: int, panels: int, dpi: int, title: str,
               labels: Optional[Sequence[str]] = None):
  """A figure of ``count`` items, ``min(count, columns)`` per row, each ``panels`` square panels
  side by side, under ``title``; returns ``(fig, axes)`` (all axes off, row-major). ValueError:
  ``labels`` given, not one per item."""
  if labels is not None and len(labels) != count:
    raise ValueError(f'labels has {len(labels)} entries for {count} images')
  cols = max(1, min(count, int(columns)))
  rows = math.ceil(count / cols)
  height = PANEL * rows + TITLE_BAND
  fig = _new_figure(panels * PANEL * cols, height, dpi)
  axes = np.atleast_2d(fig.subplots(rows, panels * cols, squeeze=False)).ravel()
  fig.subplots_adjust(left=0.01, right=0.99, bottom=0.01, top=1.0 - TITLE_BAND / height,
                      wspace=0.05, hspace=0.15)
  for ax in axes:
    ax.set_axis_off()
  fig.suptitle(title, fontsize=10)
  return fig, axes


def rollout_overlay_figure(images: Any, maps: Any, *, labels: Optional[Sequence[str]] = None,
                           columns: int = 4, title: str = 'Attention rollout',
                           alpha: float = 0.5, cmap: str = 'jet', style: str = 'heatmap',
                           dpi: int = DPI) -> mpl_figure.Figure:
  """Each image beside its rollout map ``[B, gh, gw]`` overlaid on it (ViT paper Fig. 6 / 14);
  ``columns`` images per row, optional ``B`` captions, the rest as :func:`overlay`."""
  blended = overlay(images, maps, alpha=alpha, cmap=cmap, style=style)
  shown = display_images(images)
  fig, axes = _item_grid(len(shown), columns, 2, dpi, title, labels)
  for i, picture in enumerate(shown):
    _panel(axes[2 * i], picture, 'input')
    caption = labels[i] if labels is not None else 'rollout'
    _panel(axes[2 * i + 1], blended[i], caption)
  return fig


def image_grid_figure(images: Any, *, labels: Optional[Sequence[str]] = None, columns: int = 8,
                      title: str = 'Training images', dpi: int = DPI) -> mpl_figure.Figure:
  """Images in a grid, each under its optional caption; ValueError for bad images or labels."""
  shown = display_images(images)
  fig, axes = _item_grid(len(shown), columns, 1, dpi, title, labels)
  for i, picture in enumerate(shown):
    caption = labels[i] if labels is not None else None
    _panel(axes[i], picture, caption)
  return fig


def layer_attention_figure(image: Any, maps: Any, *, rollout_map: Any = None, columns: int = 7,
                           title: str = "Class token's attention per layer",
                           alpha: float = 0.5, cmap: str = 'jet',
                           dpi: int = DPI) -> mpl_figure.Figure:
  """One image ``[H, W(, C)]`` and its per-layer maps ``[L, gh, gw]`` (and rollout) overlaid;
  ``maps``: :func:`vit_jax.analysis.layer_class_token_maps` ``[:, b]``."""
  maps = np.asarray(maps, dtype=np.float32)
  if maps.ndim != 3:
    raise ValueError(f'maps must have shape [layers, gh, gw] (one image), got {maps.shape}')
  stack = list(maps)
  names = [f'layer {i + 1}' for i in range(maps.shape[0])]
  if rollout_map is not None:
    stack.append(np.asarray(rollout_map, dtype=np.float32))
    names.append('rollout')
    if stack[-1].shape != maps.shape[1:]:
      raise ValueError(f'rollout_map has shape {stack[-1].shape}, the maps {maps.shape[1:]}')
  image = np.asarray(image)
  blended = overlay(np.repeat(image[None], len(stack), axis=0), np.stack(stack), alpha=alpha,
                    cmap=cmap)
  fig, axes = _item_grid(1 + len(stack), columns, 1, dpi, title)
  _panel(axes[0], display_images(image[None])[0], 'input')
  for ax, picture, name in zip(axes[1:], blended, names):
    _panel(ax, picture, name)
  return fig


def attention_distance_figure(distances: Any, *, image_size: Any, patch_size: Any = None,
                              title: Optional[str] = None, dpi: int = DPI) -> mpl_figure.Figure:
  """Mean attention distance ``[L, heads]`` (pixels) of every head against depth (ViT Fig. 7
  right), one colour per head; ``image_size`` / ``patch_size`` named in the title."""
  distances = np.asarray(distances, dtype=np.float64)
  if distances.ndim != 2 or not distances.size:
    raise ValueError(f'distances must have shape [layers, heads], got {distances.shape}')
  attention_maps.check_finite(distances, 'distances')
  height, width = attention_maps.as_pair(image_size, 'image_size')
  if title is None:
    title = f'Mean attention distance, {height}x{width} px images'
    if patch_size is not None:
      ph, pw = attention_maps.as_pair(patch_size, 'patch_size')
      title += f', {ph}x{pw} px patches'
  layers, heads = distances.shape
  fig = _new_figure(7.0, 4.5, dpi)
  ax = fig.add_subplot()
  palette = colormaps['tab10' if heads <= 10 else 'tab20' if heads <= 20 else 'viridis']
  depth = np.arange(1, layers + 1)
  for h in range(heads):
    shade = h if heads <= 20 else h / max(1, heads - 1)  # A listed colour, or along the map.
    ax.scatter(depth, distances[:, h], s=14, color=palette(shade), label=f'head {h + 1}')
  ax.set_xlabel('network depth (layer)')
  ax.set_ylabel('mean attention distance (pixels)')
  ax.set_xlim(0.5, layers + 0.5)
  ax.set_ylim(0.0, max(1.0, float(distances.max()) * 1.1))
  ticks = depth if layers <= 24 else depth[::max(1, layers // 12)]
  ax.set_xticks(ticks)
  ax.set_title(title, fontsize=10)
  ax.grid(alpha=0.3)
  if heads <= 16:
    ax.legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1.0), markerscale=0.8)
  fig.subplots_adjust(left=0.1, right=0.84, bottom=0.12, top=0.9)
  return fig


def _mosaic(tiles: np.ndarray, rows: int, cols: int, gap: int, fill: float) -> np.ndarray:
  """``[n, h, w(, C)]`` tiles into a ``rows x cols`` mosaic with ``gap``-pixel separators."""
  n, h, w = tiles.shape[:3]
  extra = tiles.shape[3:]
  out = np.full((rows * (h + gap) - gap, cols * (w + gap) - gap, *extra), fill, np.float32)
  for i in range(n):
    r, c = divmod(i, cols)
    out[r * (h + gap):r * (h + gap) + h, c * (w + gap):c * (w + gap) + w] = tiles[i]
  return out


def posemb_similarity_figure(similarity: Any, *, title: str = 'Position embedding similarity',
                             cmap: str = 'viridis', dpi: int = DPI) -> mpl_figure.Figure:
  """The ``gh x gw`` grid of the ``[gh, gw, gh, gw]`` cosine similarities'
  (:func:`vit_jax.analysis.posemb_similarity`) maps (ViT paper Fig. 7 centre)."""
  similarity = np.asarray(similarity, dtype=np.float32)
  if similarity.ndim != 4 or similarity.shape[:2] != similarity.shape[2:]:
    raise ValueError(f'similarity must have shape [gh, gw, gh, gw], got {similarity.shape}')
  attention_maps.check_finite(similarity, 'similarity')
  gh, gw = similarity.shape[:2]
  mosaic = _mosaic(similarity.reshape(gh * gw, gh, gw), gh, gw, 1, np.nan)
  side = max(5.0, max(gh, gw) * (max(gh, gw) + 1) / 90.0)
  width, height = side + 2.0, side + 1.0
  fig = _new_figure(width, height, dpi)
  ax = fig.add_axes((0.7 / width, 0.6 / height, side / width, side / height))
  colours = colormaps[cmap].with_extremes(bad='white')
  picture = ax.imshow(mosaic, cmap=colours, vmin=-1.0, vmax=1.0, interpolation='nearest')
  every = max(1, math.ceil(max(gh, gw) / 14))
  ax.set_xticks([c * (gw + 1) + (gw - 1) / 2 for c in range(0, gw, every)],
                [str(c + 1) for c in range(0, gw, every)], fontsize=7)
  ax.set_yticks([r * (gh + 1) + (gh - 1) / 2 for r in range(0, gh, every)],
                [str(r + 1) for r in range(0, gh, every)], fontsize=7)
  ax.set_xlabel('input patch column')
  ax.set_ylabel('input patch row')
  ax.set_title(title, fontsize=10)
  bar = fig.add_axes(((side + 0.85) / width, 0.6 / height, 0.15 / width, side / height))
  fig.colorbar(picture, cax=bar, label='cosine similarity')
  return fig


def _stretch(x: np.ndarray, axes: Tuple[int, ...]) -> np.ndarray:
  """``x`` from its min to its max over ``axes`` to [0, 1] (constant: 0.5)."""
  low = x.min(axis=axes, keepdims=True)
  span = x.max(axis=axes, keepdims=True) - low
  return np.where(span > 0, (x - low) / np.where(span > 0, span, 1.0), 0.5)


def filter_components_figure(components: Any, *, explained: Any = None, columns: int = 7,
                             scale: str = 'channel', title: Optional[str] = None,
                             dpi: int = DPI) -> mpl_figure.Figure:
  """Principal components ``[k, P, P, C]`` of the patch-embedding filters (ViT Fig. 7 left);
  ``explained``: optional ``[k]`` ratios; ``scale`` 'channel' or 'joint' (keeps colour balance).
  ValueError: C not 1 or 3 (a hybrid's filters act on ResNet features), an unknown ``scale``."""
  components = np.asarray(components, dtype=np.float32)
  if components.ndim != 4 or not components.shape[0] or components.shape[-1] not in (1, 3):
    raise ValueError(f'components must have shape [k, P, P, C] with C 1 (grayscale) or 3 (RGB) '
                     f'input channels, got {components.shape} (a hybrid ViT embeds ResNet '
                     f'features, not pixels: its filters have no picture)')
  if scale not in ('channel', 'joint'):
    raise ValueError(f"scale must be 'channel' or 'joint', got {scale!r}")
  attention_maps.check_finite(components, 'components')
  k, ph, pw, _ = components.shape
  stretch_axes = (1, 2) if scale == 'channel' else (1, 2, 3)  # Per channel or not.
  tiles = _stretch(components, stretch_axes)
  if tiles.shape[-1] == 1:
    tiles = np.repeat(tiles, 3, axis=-1)
  cols = max(1, min(k, int(columns)))
  rows = math.ceil(k / cols)
  gap = max(1, max(ph, pw) // 8)
  fig = _new_figure(float(cols), rows + 0.6, dpi)
  ax = fig.add_axes((0.01, 0.01, 0.98, rows / (rows + 0.6) - 0.01))
  _panel(ax, _mosaic(tiles, rows, cols, gap, 1.0), None)
  if title is None:
    title = f'First {k} principal components of the embedding filters'
    if explained is not None:
      title += f' ({100 * float(np.sum(explained)):.0f}% of the variance)'
  fig.suptitle(title, fontsize=9, y=1.0 - 0.1 / (rows + 0.6), va='top')
  return fig


def _writer(figure_fn: Callable[..., mpl_figure.Figure]) -> Callable[..., str]:
  """``figure_fn``'s namesake: ``(*arrays, path, **options)`` writes the figure to ``path`` (PNG)
  and returns ``path``."""
  return lambda *args, **options: write_png(figure_fn(*args[:-1], **options), args[-1])


rollout_overlay = _writer(rollout_overlay_figure)
layer_attention = _writer(layer_attention_figure)
attention_distance = _writer(attention_distance_figure)
posemb_similarity_grid = _writer(posemb_similarity_figure)
filter_components = _writer(filter_components_figure)
