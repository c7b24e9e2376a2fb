"""A trained model from any source (``vit_jax.checkpoint.ACCEPTED_FORMATS``), ready to predict,
evaluate and give features::

  trained = inference.load('/tmp/vit_fmnist')          # a workdir: its latest step, EMA if kept
  runner = inference.Runner(trained)                    # placed on this host's devices
  logits = runner.logits(images)                        # [B, H, W, 3], preprocessed -> [B, C]
  probs = trained.probabilities(logits)                 # softmax or sigmoid, as it was trained
  features = runner.features(images)                    # [B, F] pre-logits
  grid = runner.patch_grid(images, blocks=-1)           # [B, gh, gw, D] patch tokens, normed
  logits = trained.apply(images)                        # the Flax module, unjitted

The features API and its timm equivalents: docs/evaluation.md ("Features"); what a workdir or
a file rebuilds: docs/checkpoints.md ("A workdir alone rebuilds its model")."""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from absl import logging
import jax
import ml_collections
import numpy as np

from vit_jax import checkpoint
from vit_jax import config as config_lib
from vit_jax import labels
from vit_jax import models
from vit_jax import platform
from vit_jax import sharding
from vit_jax import step as step_lib
from vit_jax import storage
from vit_jax.checkpoint import orbax
from vit_jax.checkpoint import saved_run
from vit_jax.models import intermediates

#: Classes of the official ImageNet-21k checkpoints (pretrained with a sigmoid loss).
IMAGENET21K_CLASSES = 21843

#: What a source can be, in words (for error messages).
SOURCES = checkpoint.ACCEPTED_FORMATS
#: Float32 copies of an input image alive at once (decoded, batched, padded, on the device).
INPUT_COPIES = 4
#: The share of the available memory that `check_memory`'s estimate may fill.
MEMORY_SHARE = 0.8


@dataclasses.dataclass(frozen=True)
class TrainedModel:
  """A model as :func:`load` gives it: ``config`` (resolved; ``data``: the eval preprocessing),
  ``variables`` (NumPy), ``label_names`` (or None), ``multi_label`` (independent sigmoids),
  ``step`` (None for files), ``description`` (for logs, e.g. ``'/w (step 4688, EMA)'``).
  ``num_classes`` 0: a feature extractor (no head)."""

  config: ml_collections.ConfigDict
  variables: Dict[str, Any]
  label_names: Optional[Tuple[str, ...]]
  multi_label: bool
  step: Optional[int]
  description: str

  @property
  def num_classes(self) -> int:
    return int(self.config.num_classes or 0)

  @property
  def model(self) -> Any:
    """The Flax module (``vit_jax.step.create_model``) that ``variables`` fit."""
    return step_lib.create_model(self.config)

  def apply(self, images: Any, *, train: bool = False, **kwargs: Any) -> Any:
    """``model.apply(variables, images, train=train, **kwargs)``, unjitted: float32
    ``[B, S, S, 3]`` preprocessed images -> float32 ``[B, C]`` logits (``[B, F]`` features when
    ``num_classes`` is 0). Raises as the model (ValueError: a non-NHWC input)."""
    return self.model.apply(self.variables, images, train=train, **kwargs)

  @property
  def token_layout(self) -> intermediates.TokenLayout:
    """The encoder's token order at ``image_size``: prefix tokens, patch grid, stride."""
    return intermediates.token_layout(self.model, self.image_size, self.image_size)

  @property
  def image_size(self) -> int:
    """``S``: the model's input is ``[B, S, S, 3]``."""
    return int(self.config.data.image_size)

  def probabilities(self, logits: np.ndarray) -> np.ndarray:
    """``[B, C]`` logits -> float32 ``[B, C]``: softmax, or sigmoids for ``sigmoid_xent``."""
    logits = np.asarray(logits, np.float64)
    if self.config.loss == 'sigmoid_xent':
      return (1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return (shifted / shifted.sum(axis=-1, keepdims=True)).astype(np.float32)

  def label_name(self, index: int) -> str:
    """The name of class ``index`` (its number as text when the names are unknown)."""
    known = self.label_names and 0 <= index < len(self.label_names)
    return self.label_names[index] if known else str(index)

  def data_config(self, *, name: Optional[str] = None, image_folder: Optional[str] = None,
                  split: Optional[str] = None, **changes: Any) -> ml_collections.ConfigDict:
    """``config.data`` (the eval preprocessing) for another dataset (tfds ``name`` or
    ``image_folder``) or eval ``split``."""
    data = ml_collections.ConfigDict(self.config.data.to_dict())
    if image_folder is not None:
      data.image_folder = image_folder
      data.name = None
    elif name is not None:
      data.name = name
      data.image_folder = None
    if split is not None:
      data.eval_split = split
    data.update(changes)
    return data


def _for_devices(config: ml_collections.ConfigDict,
                 devices: Sequence[Any]) -> ml_collections.ConfigDict:
  """``config`` on ``devices``: its mesh if it fits (else data parallel), an eval batch the mesh
  can split, attention and remat chosen for them."""
  config = ml_collections.ConfigDict(config.to_dict())
  try:
    sharding.check_slices(config.mesh, devices)
    sharding.axis_sizes(config.mesh, len(devices))
  except ValueError:
    config.mesh.update(data=-1, fsdp=1, tensor=1, dcn_data=1)
  shards = step_lib.batch_shards(config.mesh, len(devices))
  batch = int(config.eval_batch_size or config.batch_size or shards)
  config.eval_batch_size = -(-batch // shards) * shards
  config.model.attention = config_lib.attention_choice(config, 'auto', devices).implementation
  remat = config_lib.remat_choice(config.model, devices)
  if remat is not None:
    config.model.remat_policy = remat.implementation
  return config


def _from_run(path: str, contents: checkpoint.Contents, model_name: Optional[str],
              overrides: Dict[str, Any], num_classes: Optional[int],
              image_size: Optional[int]) -> TrainedModel:
  """A training run's model, rebuilt by its saved config."""
  run = contents.run
  config = config_lib.from_json(run.config)
  if num_classes not in (None, 0) and num_classes != config.num_classes:
    raise ValueError(f'--num-classes {num_classes}: {path} is a training workdir of '
                     f'{config.model_name} with num classes {config.num_classes} (its saved '
                     'config); drop --num-classes (or convert it to .npz: python -m '
                     'vit_jax.convert).')
  if model_name and models.resolve(model_name)[0] is not models.resolve(config.model_name)[0]:
    raise ValueError(f'{path} holds a {config.model_name} trained by vit_jax: its config '
                     f'rebuilds the model; drop --model {model_name}.')
  if model_name or overrides:
    raise ValueError(f'{path} is a training workdir of {config.model_name}: its saved config '
                     'rebuilds the model; drop --model/--set.')
  names = contents.label_names
  if run.dataset is None:  # Saved before the record existed: ask the dataset, if it is here.
    names = _names_from_data(config)
  return TrainedModel(config, contents.variables, names, bool(contents.multi_label), run.step,
                      contents.description)


def _names_from_data(config: ml_collections.ConfigDict) -> Optional[Tuple[str, ...]]:
  """The class names of the run's training data when it is readable here, else None."""
  from vit_jax import data  # pylint: disable=g-import-not-at-top  (TensorFlow)
  try:
    names = data.get_info(config.data).label_names
  except Exception as e:  # pylint: disable=broad-except  (not prepared here, moved, ...)
    logging.info('No class names for the run: its dataset is not readable here (%s).', e)
    return None
  return tuple(names) if len(names) == int(config.num_classes) else None


def _from_weights(path: str, contents: checkpoint.Contents, model_name: Optional[str],
                  overrides: Dict[str, Any], num_classes: Optional[int],
                  image_size: Optional[int]) -> TrainedModel:
  """Weights without a config: a model of their architecture (ViT: from the shapes; T2T-ViT:
  ``model_name``) with their paper's evaluation settings."""
  variables = contents.variables
  if models.layout.is_scanned(variables['params']):  # A scanned run's: built per layer.
    variables = models.unscan_params(variables)
  implied = contents.fields
  classes = contents.num_classes
  if implied is None and not model_name:
    raise ValueError(f'{path} holds no ViT parameters (no embedding/kernel) and no config: for '
                     'T2T-ViT weights name the model with --model (e.g. --model T2T-ViT-14).')
  if classes is None and num_classes != 0:
    raise ValueError(f'{path} has no classification head (head/kernel): it cannot predict '
                     'classes. Load it as a feature extractor with num_classes=0 (timm\'s '
                     'num_classes=0) for its features (vit_jax.inference.Runner.features, '
                     'tokens, patch_grid).')
  if num_classes not in (None, 0) and int(num_classes) != classes:
    raise ValueError(f"--num-classes {num_classes} does not match {path}: its head has "
                     f"{classes} classes; drop --num-classes (the head decides).")
  fields = {**contents.numerics, **overrides}
  if implied is not None and model_name is None:
    hybrid = 'resnet_num_layers' in implied
    model_name = 'R+ViT-custom' if hybrid else 'ViT-custom'
    fields = {**{k: v for k, v in implied.items()
                 if k != 'num_classes' and (hybrid or k != 'resnet_width_factor')}, **fields}
  elif implied is not None:  # What the weights compute, whatever the name says.
    for field in models.vit_fields.VIT_FIELDS:  # The recorded fields a name does not fix.
      if field.in_weights and field.default is not models.fields.REQUIRED and (
          implied.get(field.name) is not None):
        fields.setdefault(field.name, implied[field.name])
  image_size = image_size or contents.image_size
  if image_size is None:
    if implied and implied['posemb'] != 'learn':
      message = (f"{path} has no learned position table (posemb='sincos2d', which fits any "
                 'resolution): give the image size (--image-size, e.g. 224).')
    else:
      message = (f'{path}: its position table is not a square grid; give the image size '
                 '(--image-size).')
    raise ValueError(message)
  # A config of the evaluation settings of their paper; never trained: any valid schedule.
  config = config_lib.get_config(model_name, 'imagenet2012',
                                 **dict(fields, scan=False, remat=False))
  config.regime = 'pretrain' if classes == IMAGENET21K_CLASSES else 'finetune'
  config = config_lib.fill_regime(config)
  config.update(num_classes=classes or None, total_steps=1, batch_size=64, eval_batch_size=64)
  config.optim.warmup_steps = 0
  config.data.update(image_size=int(contents.image_size or image_size),
                     normalization=contents.normalization, eval_crop_pct=contents.eval_crop_pct)
  multi_label = (classes == IMAGENET21K_CLASSES if contents.multi_label is None
                 else contents.multi_label)
  names = (contents.label_names or labels.official_label_names(classes)) if classes else None
  return TrainedModel(config, variables, names, bool(multi_label), None, contents.description)


def _without_head(trained: TrainedModel) -> TrainedModel:
  """``trained`` as a feature extractor: no ``head`` (``config.num_classes`` None), no classes."""
  config = ml_collections.ConfigDict(trained.config.to_dict())
  config.num_classes = None
  params = {k: v for k, v in trained.variables['params'].items() if k != 'head'}
  return dataclasses.replace(trained, config=config, label_names=None, multi_label=False,
                             variables=dict(trained.variables, params=params))


def _at_image_size(config: ml_collections.ConfigDict, image_size: int,
                   path: str) -> ml_collections.ConfigDict:
  """``config`` on ``image_size`` px images: a ViT's learned position table resampled in the
  model (``posemb_grid``, ``posemb_resize``), a sincos2d one computed for it. ValueError for
  T2T-ViT, whose fixed table is stored at its training size."""
  native = int(config.data.image_size)
  if int(image_size) == native:
    return config
  if models.resolve(config.model_name)[0].module is not models.VisionTransformer:
    raise ValueError(f'--image-size {image_size}: {path} is a {config.model_name} for '
                     f'{native} px images, whose stored position table fits no other size; drop '
                     f'--image-size (or give {native}).')
  config = ml_collections.ConfigDict(config.to_dict())
  config.data.image_size = int(image_size)
  if config.model.posemb == 'learn' and config.model.posemb_grid is None:
    sy, sx = models.vit.token_stride(step_lib.create_model(config), native, native)
    config.model.posemb_grid = (native // sy, native // sx)
    logging.info('%s at %d px: its position table (%dx%d tokens, %d px) resampled in the model '
                 '(%s).', path, image_size, *config.model.posemb_grid, native,
                 config.model.posemb_resize)
  return config


def _device_memory(device: Any) -> Optional[int]:
  """The bytes a program may take on an accelerator (its `memory_stats`), None when unknown."""
  try:
    return int((device.memory_stats() or {}).get('bytes_limit') or 0) or None
  except Exception:  # pylint: disable=broad-except  (not implemented on this platform)
    return None


def _bytes(n: float) -> str:
  """'1.5 GiB', '12.0 MiB' (below 1 GiB)."""
  return f'{n / 2**30:,.1f} GiB' if n >= 2**30 else f'{n / 2**20:,.1f} MiB'


def _largest(limit: int, fits) -> int:
  """The largest n in [1, limit] for which `fits(n)` (monotone), 0 if none."""
  return bisect.bisect_left(range(1, limit + 1), True, key=lambda n: not fits(n))


def check_memory(config: ml_collections.ConfigDict, devices: Sequence[Any], batch: int = 1, *,
                 host_bytes: Optional[int] = None, device_bytes: Optional[int] = None) -> None:
  """Refuses `config.data.image_size` (S) where `batch` images would not fit (a rough estimate):
  `INPUT_COPIES` float32 [S, S, 3] inputs in the host's available memory (`host_bytes`), the
  forward pass of each (`vit_jax.config.slices.forward_bytes`) in the devices' (CPU: the host's;
  else `device_bytes`, default their `memory_stats`), each within `MEMORY_SHARE`; unknown sizes
  are unchecked. ValueError naming the largest image size or batch that fits."""
  devices = list(devices)
  on_cpu = all(d.platform == 'cpu' for d in devices)
  host = platform.available_memory_bytes() if host_bytes is None else host_bytes
  device = None if on_cpu else device_bytes or _device_memory(devices[0])
  fields = config.model.to_dict()

  def short(size: int, images: int) -> Optional[Tuple[float, float, float, str]]:
    """(needed, inputs, forward, of what) where `images` would not fit, else None."""
    inputs = INPUT_COPIES * images * size * size * 3 * 4
    per_device = images if on_cpu else -(-images // len(devices))
    forward = per_device * config_lib.slices.forward_bytes(config.model_name, fields, size)
    parts = ([(inputs + forward, host, 'on this host')] if on_cpu else
             [(inputs, host, 'on this host'), (forward, device, f'on a {devices[0].device_kind}')])
    for needed, available, where in parts:
      if available and needed > MEMORY_SHARE * available:
        return needed, inputs, forward, (f'{MEMORY_SHARE:.0%} of the {_bytes(available)} '
                                          f'available {where}')
    return None

  size = int(config.data.image_size)
  found = short(size, batch)
  if found is None:
    return
  needed, inputs, forward, memory = found
  fixes = []
  if 'patch_size' in fields:  # A ViT: any multiple of its token stride (T2T-ViT: its size only).
    stem = fields.get('resnet_num_layers')
    stride = int(fields['patch_size'][0]) * (1 if stem is None else
                                             models.resnet.resnet_stride(stem))
    largest = _largest(size // stride - 1, lambda k: short(k * stride, batch) is None)
    fixes += [f'--image-size {largest * stride} or less'] if largest else []
  fitting = _largest(batch - 1, lambda b: short(size, b) is None)
  fixes += [f'a batch of {fitting} or fewer images (--batch-size)'] if fitting else []
  fix = (f'Give {" or ".join(fixes)}.' if fixes else
         'Nothing smaller fits: use a machine with more memory.')
  attention = fields.get('attention')
  matrices = (f" ({attention} attention's [tokens, tokens] matrices included)"
              if attention != 'cudnn' else '')
  what = f'{batch} images of {size}x{size} px' if batch > 1 else f'one {size}x{size} px image'
  verb = 'need' if batch > 1 else 'needs'
  raise ValueError(
      f'{what} for {config.model_name} {verb} ~{_bytes(needed)} '
      f'({INPUT_COPIES} float32 copies of the input: {_bytes(inputs)}; the forward pass'
      f'{matrices}: {_bytes(forward)}), more than {memory}. {fix}')


def load(source: Any, *, step: Optional[int] = None, use_ema: bool = True,
         model_name: Optional[str] = None, num_classes: Optional[int] = None,
         image_size: Optional[int] = None, overrides: Optional[Dict[str, Any]] = None,
         devices: Optional[Sequence[Any]] = None) -> TrainedModel:
  """The :class:`TrainedModel` of ``source`` (:data:`SOURCES`, local or ``gs://``), checked to
  fit its model. ``step``: a workdir's (default the latest); ``use_ema``: the parameter EMA when
  saved; ``model_name``: required for ``.pth.tar`` files and T2T-ViT convert directories, checked
  for ``.npz``, refused for workdirs, 'auto' as None; ``num_classes``: checked against the head,
  0 a feature extractor (the head dropped); ``image_size``: default the position table's
  (:func:`_at_image_size`); ``overrides``: model fields; ``devices``: default all.

  Raises FileNotFoundError (nothing at ``source``, ``step`` not saved) or ValueError (no known
  format, a damaged or unsafe file, a model that does not fit the weights, a class count other
  than the head's, NaN or Inf values)."""
  path = storage.normalize(source)
  if not str(path).strip():
    raise ValueError(f'No source given: give {SOURCES}.')
  if not storage.exists(path):
    raise FileNotFoundError(f'{path} does not exist: give {SOURCES}.')
  overrides = dict(overrides or {})
  if model_name == 'auto':  # As main's --config.model_name=auto: the model the weights record.
    model_name = None
  ckpt = checkpoint.open(path)
  contents = ckpt.contents(use_ema=use_ema, step=step, model_name=model_name,
                           overrides=overrides)
  build = _from_run if contents.run is not None else _from_weights
  trained = build(path, contents, model_name, overrides, num_classes, image_size)
  if num_classes == 0:
    trained = _without_head(trained)
  devices = list(jax.devices() if devices is None else devices)
  config = _for_devices(trained.config, devices)
  if contents.run is None and 'posemb_resize' in config.model and (
      'posemb_resize' not in overrides):  # Weights alone: their library's resize (timm's).
    config.model.posemb_resize = checkpoint.posemb_resize(ckpt, step_lib.create_model(config))
  if image_size is not None:  # The model built for its table's size, applied at another.
    config = _at_image_size(config, image_size, path)
  check_memory(config, devices)  # One image at a time; `Runner` checks its batch.
  model = step_lib.create_model(config)
  try:
    checkpoint.check_fits(trained.variables, models.abstract_variables(
        model, (config.data.image_size, config.data.image_size)), what=path)
  except ValueError as e:
    if not model_name:
      raise
    implied = checkpoint.describe_architecture(trained.variables) or ''
    raise ValueError(f'{path} does not fit --model {model_name}. {implied} Name the model these '
                     'weights are of (an .npz needs no --model: its shapes give it).') from e
  _check_finite(path, trained, use_ema)
  return dataclasses.replace(trained, config=config)


def _check_finite(path: str, trained: TrainedModel, use_ema: bool) -> None:
  """Raises ValueError for NaN or Inf values, naming them (and a run's newest finite step)."""
  bad = checkpoint.non_finite(trained.variables)
  if not bad:
    return
  what = f'{path} (step {trained.step})' if trained.step is not None else path
  advice = 'Use weights without them (re-export or re-download the file).'
  steps = saved_run.read_run(path).steps if trained.step is not None else []  # []: a step dir.
  if steps:
    finite = next((s for s in reversed(steps) if s < trained.step and not checkpoint.non_finite(
        orbax.read_variables(saved_run.find_state_item(path, s), use_ema=use_ema))), None)
    advice = (f'Give --step {finite}, the newest step whose values are finite.'
              if finite is not None else 'No earlier step of the run is finite: train it again.')
  elif trained.step is not None:
    advice = 'Give an earlier step of the run (its workdir, with --step).'
  raise ValueError(f'{checkpoint.non_finite_message(what, bad)}: its outputs would be '
                   f'meaningless. {advice}')


class Runner:
  """A :class:`TrainedModel` on a device mesh (``setup``: ``vit_jax.step.Setup``). Each method
  takes this process's preprocessed float32 ``[B, S, S, 3]`` (any B; run in batches of
  ``batch_size``, the global eval batch, the last padded); ValueError for another shape."""

  def __init__(self, trained: TrainedModel, *, devices: Optional[Sequence[Any]] = None):
    self.trained = trained
    size = trained.image_size
    local_devices = jax.local_devices() if devices is None else devices
    local_batch = int(trained.config.eval_batch_size) // jax.process_count()
    check_memory(trained.config, local_devices, local_batch)
    self.setup = step_lib.build(trained.config, image_shape=(size, size, 3), devices=devices)
    variables = dict(trained.variables)
    state = {'params': variables.pop('params'), **({'model_state': variables} if variables else {})}
    self.state = jax.device_put(state, self.setup.variables_shardings)
    self.batch_size = int(trained.config.eval_batch_size)
    self.layout = trained.token_layout
    self._steps: Dict[Any, Any] = {}
    self._compiler = step_lib.Compiler(self.setup)

  def _step(self, key: Any, make: Callable[[], Any]) -> Any:
    if key not in self._steps:
      self._steps[key] = make()
    return self._steps[key]

  def _padded(self, images: np.ndarray, step: Any) -> Any:
    """The jitted ``step``'s outputs (batch-first arrays, or a tuple of them) as NumPy."""
    images = np.asarray(images, np.float32)
    if images.ndim != 4 or images.shape[1:] != (self.trained.image_size,) * 2 + (3,):
      s = self.trained.image_size
      raise ValueError(f'Images of shape {images.shape}: the model takes [B, {s}, {s}, 3] '
                       '(preprocessed as its config.data says).')
    local = self.batch_size // jax.process_count()
    if not len(images):  # The outputs' shapes, with no rows.
      spec = jax.ShapeDtypeStruct((self.batch_size,) + images.shape[1:], np.float32,
                                  sharding=self.setup.batch_sharding)
      shapes = self.setup.in_mesh(jax.eval_shape)(step, self.state, spec)
      return jax.tree.map(lambda x: np.zeros((0,) + x.shape[1:], x.dtype), shapes)
    out = []
    for start in range(0, len(images), local):
      chunk = images[start:start + local]
      padded = np.pad(chunk, [(0, local - len(chunk))] + [(0, 0)] * 3)
      result = self._compiler(step, self.state, self.setup.to_global(padded))
      out.append(jax.tree.map(lambda x, n=len(chunk): self.setup.to_local(x)[:n], result))
    return jax.tree.map(lambda *parts: np.concatenate(parts), *out)

  def logits(self, images: np.ndarray) -> np.ndarray:
    """``[B, S, S, 3]`` -> float32 ``[B, C]`` logits. ValueError for a feature extractor."""
    if not self.trained.num_classes:
      raise ValueError(f'{self.trained.description} was loaded as a feature extractor '
                       '(num_classes=0, no head): it has no logits. Use features, tokens or '
                       'patch_grid, or load weights with a head without num_classes=0.')
    return self._padded(images, self._step('logits', lambda: self.setup.jit_features_step(
        head=True)))

  def features(self, images: np.ndarray) -> np.ndarray:
    """``[B, S, S, 3]`` -> float32 ``[B, F]`` pre-logits (`vit_jax.step.make_features_step`)."""
    return self._padded(images, self._step('features', self.setup.jit_features_step))

  def tokens(self, images: np.ndarray, *, blocks: Any = -1, norm: bool = True) -> np.ndarray:
    """``[B, S, S, 3]`` -> float32 ``[B, N, D]``: every token (in ``layout``'s order) as block
    ``blocks`` (0 the first, -1 the last) outputs it; a sequence of blocks gives
    ``[K, B, N, D]``. ``norm``: through the final LayerNorm
    (``vit_jax.models.intermediates.final_norm``); the default is timm's ``forward_features``.
    ValueError: a block the model does not have."""
    try:
      chosen = (blocks,) if isinstance(blocks, (int, np.integer)) else tuple(blocks)
      if not chosen or any(isinstance(b, bool) or b != int(b) for b in chosen):
        raise IndexError('give a block index (0 the first, -1 the last) or a sequence of them.')
      chosen = tuple(int(b) for b in chosen)
      step = self._step(('tokens', chosen, bool(norm)),
                        lambda: self.setup.jit_tokens_step(chosen, norm=bool(norm)))
    except (IndexError, TypeError, ValueError) as e:
      raise ValueError(f'blocks={blocks!r}: {e}') from e
    out = self._padded(images, step)
    return out[0] if isinstance(blocks, (int, np.integer)) else np.stack(out)

  def patch_grid(self, images: np.ndarray, *, blocks: Any = -1, norm: bool = True) -> np.ndarray:
    """:meth:`tokens` without the prefix tokens, as float32 ``[B, gh, gw, D]`` (``[K, B, gh,
    gw, D]`` for a sequence of blocks): timm's ``forward_intermediates`` in NHWC."""
    tokens = self.tokens(images, blocks=blocks, norm=norm)
    patches = tokens[..., self.layout.prefix:, :]
    return patches.reshape(patches.shape[:-2] + tuple(self.layout.grid) + patches.shape[-1:])

  def eval_sums(self, batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """The eval step's sums of a process-local ``{'image', 'labels', 'mask'}``, over all hosts."""
    step = self._step('eval', lambda: self.setup.jit_eval_step(variables_only=True))
    return jax.device_get(self._compiler(step, self.state, self.setup.to_global(batch)))
