"""`config.analysis`'s TensorBoard pictures (docs/analysis.md): the first eval images' mean
attention distance (ViT Fig. 7 right) and rollout maps (Fig. 6) at every evaluation, computed on
the device as `vit_jax.analysis` does on the host; the first training images at the start.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from vit_jax import step as step_lib
from vit_jax.analysis import attention_maps
from vit_jax.models import intermediates


def _device_summary(model: Any, layout: intermediates.TokenLayout, count: int, shown: int
                    ) -> Callable[[Any, dict], dict]:
  """`(variables, global eval batch) -> {'attention_distance' [L, heads] f32 pixels, 'rollout'
  [shown, gh, gw] in [0, 1], 'logits', 'images', 'labels' of the first `shown`}` over the first
  `count` images (masked ones left out). The rollout maps: the class token's row, or without one
  the mean of the patch rows (as `vit_jax.analysis.class_token_map`; registers never)."""
  distances = jnp.asarray(attention_maps.patch_distances(layout.grid, layout.stride), jnp.float32)
  prefix = layout.prefix
  grid = layout.grid
  class_token = attention_maps.has_class_token(prefix, int(getattr(model, "num_registers", 0)))

  def summarize(state, batch):
    images = batch["image"][:count]
    mask = batch["mask"][:count].astype(jnp.float32)
    logits, state = model.apply(step_lib.variables_of(state), images, train=False,
                                mutable=[intermediates.COLLECTION])
    maps = intermediates.unpack(model, state[intermediates.COLLECTION])["attention"]
    per_layer = []
    for weights in maps:  # [M, heads, N, N]: patch queries and keys, rows renormalised.
      patches = weights[:, :, prefix:, prefix:].astype(jnp.float32)
      patches = patches / jnp.maximum(patches.sum(-1, keepdims=True), 1e-30)
      per_image = (patches * distances).sum(-1).mean(-1)  # [M, heads]
      per_layer.append((per_image * mask[:, None]).sum(0) / jnp.maximum(mask.sum(), 1.0))
    n = maps[0].shape[-1]
    eye = jnp.eye(n, dtype=jnp.float32)
    product = jnp.broadcast_to(eye, (shown, n, n))
    for weights in maps:  # Residual-aware rollout of the head-mean attention, bottom first.
      fused = 0.5 * weights[:shown].astype(jnp.float32).mean(1) + 0.5 * eye
      product = (fused / fused.sum(-1, keepdims=True)) @ product
    rows = product[:, 0, prefix:] if class_token else product[:, prefix:, prefix:].mean(-2)
    rows = rows / jnp.maximum(rows.max(-1, keepdims=True), 1e-30)
    return {"attention_distance": jnp.stack(per_layer), "rollout": rows.reshape(shown, *grid),
            "logits": logits[:shown], "images": images[:shown], "labels": batch["labels"][:shown]}

  return summarize


def _figures():
  """`vit_jax.analysis.figures`, imported when a picture is drawn (matplotlib is slow to load)."""
  from vit_jax.analysis import figures  # pylint: disable=g-import-not-at-top  (~2 s, measured)
  return figures


class Pictures:
  """A run's `config.analysis` pictures: `setup`'s model, the C `label_names` (captions),
  `first_eval_batch()` (this process's, read once) and the run's `compiler`."""

  def __init__(self, setup: step_lib.Setup, label_names: Sequence[str],
               first_eval_batch: Callable[[], dict], compiler: step_lib.Compiler):
    self._setup = setup
    self._names = list(label_names)
    self._first_eval_batch = first_eval_batch
    self._compiler = compiler
    self._options = setup.config.analysis
    self._jitted = None
    self._batch: Optional[dict] = None
    height, width = setup.image_shape[:2]
    self._layout = (intermediates.token_layout(setup.model, height, width)
                    if self.attention_on else None)

  @property
  def attention_on(self) -> bool:
    return self._options.attention_images > 0

  def _captions(self, labels: np.ndarray, logits: Optional[np.ndarray] = None) -> list:
    """Each example's top label name, or with `logits` `figures.prediction_caption`'s."""
    figures = _figures()
    name = lambda i: self._names[i] if 0 <= i < len(self._names) else str(i)
    truth = [name(int(t)) for t in np.argmax(labels, axis=-1)]
    if logits is None:
      return truth
    return [figures.prediction_caption(name(int(p)), t)
            for p, t in zip(np.argmax(logits, axis=-1), truth)]

  def training_images(self, writer: Any, batch: dict, step: int) -> None:
    """Writes 'analysis/training_images' at `step` from this process's numpy training `batch`
    (process 0, `train_images` > 0)."""
    count = min(self._options.train_images, len(batch["image"]))
    if not count or jax.process_index() > 0:
      return
    figures = _figures()
    captions = self._captions(np.asarray(batch["labels"][:count]))
    fig = figures.image_grid_figure(np.asarray(batch["image"][:count]), labels=captions,
                                    title=f"Training images as the model sees them (step {step})")
    writer.write_images(step, {"analysis/training_images": figures.to_rgb(fig)[None]})

  def attention(self, writer: Any, state: step_lib.State, step: int) -> dict[str, float]:
    """Captures the attention of `state['params']` on the first eval images (on every process)
    and writes the figures (process 0); returns the scalars written, `{}` when off."""
    if not self.attention_on:
      return {}
    setup = self._setup
    options = self._options
    variables = {k: state[k] for k in setup.variables_shardings}
    if self._batch is None:
      self._batch = setup.to_global(self._first_eval_batch())
    if self._jitted is None:
      shown = min(options.rollout_images, options.attention_images)
      replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())
      self._jitted = jax.jit(
          _device_summary(setup.model, self._layout, options.attention_images, shown),
          in_shardings=(setup.variables_shardings, setup.batch_sharding), out_shardings=replicated)
    summary = jax.device_get(self._compiler(self._jitted, variables, self._batch))
    distances = np.asarray(summary["attention_distance"], np.float64)
    scalars = {f"analysis/attention_distance/layer_{i + 1}": float(d.mean())
               for i, d in enumerate(distances)}
    writer.write_scalars(step, scalars)
    if jax.process_index() == 0:
      figures = _figures()
      height, width = setup.image_shape[:2]
      pictures = {"analysis/attention_distance": figures.attention_distance_figure(
          distances, image_size=(height, width), patch_size=self._layout.stride,
          title=f"Mean attention distance at step {step} ({options.attention_images} images)")}
      if len(summary["rollout"]):
        pictures["analysis/rollout"] = figures.rollout_overlay_figure(
            summary["images"], summary["rollout"],
            labels=self._captions(summary["labels"], summary["logits"]),
            title=f"Attention rollout at step {step}")
      writer.write_images(step, {k: figures.to_rgb(v)[None] for k, v in pictures.items()})
    return scalars
