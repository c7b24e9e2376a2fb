"""A trained model from any source (``vit_jax.checkpoint.ACCEPTED_FORMATS``), ready to predict,
evaluate and give features::

  trained = inference.load('/tmp/vit_fmnist')          # a workdir: its latest step, EMA if kept
  runner = inference.Runner(trained)                    # placed on this host's devices
  logits = runner.logits(images)                        # [B, H, W, 3], preprocessed -> [B, C]
  probs = trained.probabilities(logits)                 # softmax or sigmoid, as it was trained

A workdir rebuilds its model from its saved config and data record; files get their papers'
evaluation settings (docs/checkpoints.md, "A workdir alone rebuilds its model").
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Dict, Optional, Sequence, Tuple

from absl import logging
import jax
import ml_collections
import numpy as np

from vit_jax import checkpoint
from vit_jax import config as config_lib
from vit_jax import labels
from vit_jax import models
from vit_jax import sharding
from vit_jax import step as step_lib
from vit_jax.checkpoint import ecosystem
from vit_jax.checkpoint import mismatch
from vit_jax.checkpoint import orbax
from vit_jax.checkpoint import paths
from vit_jax.checkpoint import vit_shapes
from vit_jax.checkpoint import workdir

#: Classes of the official ImageNet-21k checkpoints (pretrained with a sigmoid loss).
IMAGENET21K_CLASSES = 21843

#: What a source can be, in words (for error messages).
SOURCES = checkpoint.ACCEPTED_FORMATS


@dataclasses.dataclass(frozen=True)
class TrainedModel:
  """A model as :func:`load` gives it: ``config`` (resolved, as training uses it; ``data`` is the
  eval preprocessing; the attention chosen for the local devices), ``variables`` (NumPy, in
  ``config.model``'s layout), ``label_names`` (or None), ``multi_label`` (independent sigmoids),
  ``step`` (None for files) and ``description`` (for logs, e.g. ``'/w (step 4688, EMA)'``)."""

  config: ml_collections.ConfigDict
  variables: Dict[str, Any]
  label_names: Optional[Tuple[str, ...]]
  multi_label: bool
  step: Optional[int]
  description: str

  @property
  def model(self):
    return step_lib.create_model(self.config)

  @property
  def num_classes(self) -> int:
    return int(self.config.num_classes)

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
    if self.label_names and 0 <= index < len(self.label_names):
      return self.label_names[index]
    return str(index)

  def data_config(self, *, name: Optional[str] = None, image_folder: Optional[str] = None,
                  split: Optional[str] = None, **changes: Any) -> ml_collections.ConfigDict:
    """``config.data`` (the eval preprocessing) for another dataset (tfds ``name`` or
    ``image_folder``) or eval ``split``."""
    data = ml_collections.ConfigDict(self.config.data.to_dict())
    if image_folder is not None:
      data.image_folder, data.name = image_folder, None
    elif name is not None:
      data.name, data.image_folder = name, None
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
    sharding.axis_sizes(config.mesh, len(devices))
  except ValueError:
    config.mesh.update(data=-1, fsdp=1, tensor=1, dcn_data=1)
  shards = step_lib.batch_shards(config.mesh, len(devices))
  batch = int(config.eval_batch_size or config.batch_size or shards)
  config.eval_batch_size = -(-batch // shards) * shards
  config.model.attention = config_lib.attention_choice(config, 'auto', devices).implementation
  remat = config_lib.remat_choice(config, devices)
  if remat is not None:
    config.model.remat_policy = remat.implementation
  return config


def _label_names(dataset: Optional[Dict[str, Any]], num_classes: int, run: workdir.SavedRun
                 ) -> Tuple[Optional[Tuple[str, ...]], Optional[bool]]:
  """The class names and multi-label flag of a run's dataset record. Raises ValueError: it names
  another number of classes than the head has."""
  if not dataset:
    return None, None
  names = tuple(dataset.get('label_names') or ()) or None
  if names is not None and len(names) != num_classes:
    record, of_step = run.dataset_source()
    if of_step:
      where, fix = (f'The dataset record of step {run.step} ({record})',
                    'the checkpoint is inconsistent: use another step (--step)')
    else:
      where, fix = (f'The dataset record {record}',
                    f'restore this run\'s {record}, or delete it (the names then come from the '
                    'training data, when it is on this machine)')
    raise ValueError(f'{where} names {len(names)} classes, but the model\'s head has '
                     f'{num_classes} outputs: the names are not this model\'s; {fix}.')
  return names, dataset.get('multi_label')


def _with_kept(trained: TrainedModel, kept: Dict[str, Any], item: str) -> TrainedModel:
  """A convert directory's model with what convert kept of its source (class names, eval
  preprocessing). Raises ValueError: the kept names are not one per output of the head."""
  if not kept:
    return trained
  names = kept.get('label_names')
  if names is not None and len(names) != trained.num_classes:
    record = paths.join(item, orbax.EXPORT_JSON)
    raise ValueError(f'{record} names {len(names)} classes, but the model\'s head has '
                     f'{trained.num_classes} outputs: the names are not this model\'s; restore '
                     'the file, or delete it (then 1,000 or 21,843 classes get the official '
                     'ImageNet names, others their numbers).')
  config = ml_collections.ConfigDict(trained.config.to_dict())
  for key in ('normalization', 'eval_crop_pct'):
    if key in kept:
      config.data[key] = kept[key]
  return dataclasses.replace(
      trained, config=config, label_names=tuple(str(n) for n in names) if names else
      trained.label_names, multi_label=bool(kept.get('multi_label', trained.multi_label)))


def _from_run(path: str, run: workdir.SavedRun, use_ema: bool, model_name: Optional[str],
              overrides: Dict[str, Any], num_classes: Optional[int] = None,
              image_size: Optional[int] = None) -> TrainedModel:
  config = config_lib.from_json(run.config)
  for flag, given, saved in (('--num-classes', num_classes, config.num_classes),
                             ('--image-size', image_size, config.data.image_size)):
    if given is not None and given != saved:
      raise ValueError(f'{flag} {given}: {path} is a training workdir of {config.model_name} '
                       f'with {flag[2:].replace("-", " ")} {saved} (its saved config); drop '
                       f'{flag} (or convert it to .npz: python -m vit_jax.convert).')
  if model_name and models.resolve(model_name)[0] is not models.resolve(config.model_name)[0]:
    raise ValueError(f'{path} holds a {config.model_name} trained by vit_jax: its config '
                     f'rebuilds the model; drop --model {model_name}.')
  if model_name or overrides:
    raise ValueError(f'{path} is a training workdir of {config.model_name}: its saved config '
                     'rebuilds the model; drop --model/--set.')
  variables = orbax.read_variables(run.state_item, use_ema=use_ema)
  names, multi_label = _label_names(run.dataset, int(config.num_classes), run)
  if run.dataset is None:  # Saved before the record existed: ask the dataset, if it is here.
    names = _names_from_data(config)
  if multi_label is None:
    multi_label = config.loss == 'sigmoid_xent'
  weights = 'EMA parameters' if use_ema and run.has_ema else 'parameters'
  return TrainedModel(config, variables, names, bool(multi_label), run.step,
                      f'{path} (step {run.step}, {weights})')


def _names_from_data(config: ml_collections.ConfigDict) -> Optional[Tuple[str, ...]]:
  """The class names of the run's training data when it is readable here, else None."""
  from vit_jax import data  # pylint: disable=g-import-not-at-top  (TensorFlow)
  try:
    names = data.get_info(config.data).label_names
  except Exception as e:  # pylint: disable=broad-except  (not prepared here, moved, ...)
    logging.info('No class names for the run: its dataset is not readable here (%s).', e)
    return None
  return tuple(names) if len(names) == int(config.num_classes) else None


def _official_config(model_name: str, num_classes: int, image_size: int, *, normalization: str,
                     eval_crop_pct: Optional[float], overrides: Dict[str, Any]
                     ) -> ml_collections.ConfigDict:
  """A config for weights that came without one: the evaluation settings of their paper."""
  overrides = dict(overrides, scan=False, remat=False)
  config = config_lib.get_config(model_name, 'imagenet2012', **overrides)
  config.regime = 'pretrain' if num_classes == IMAGENET21K_CLASSES else 'finetune'
  config = config_lib.fill_regime(config)
  config.num_classes = num_classes
  config.total_steps, config.optim.warmup_steps = 1, 0  # Never trained: any valid schedule.
  config.batch_size = config.eval_batch_size = 64
  config.data.image_size = image_size
  config.data.normalization = normalization
  config.data.eval_crop_pct = eval_crop_pct
  return config


def _grid_side(tokens: int, what: str) -> int:
  side = math.isqrt(tokens)
  if side * side != tokens:
    raise ValueError(f'{what} has {tokens} position(s), not a square grid: give image_size '
                     '(--image-size).')
  return side


def _shapes(variables: Dict[str, Any]) -> Dict[str, Tuple[int, ...]]:
  return {k: tuple(np.shape(v)) for k, v in checkpoint.flatten_params(variables).items()}


def _from_vit_weights(path: str, variables: Dict[str, Any], model_name: Optional[str],
                      num_classes: Optional[int], image_size: Optional[int],
                      overrides: Dict[str, Any]) -> TrainedModel:
  shapes = _shapes(variables)
  fields = vit_shapes.architecture_fields(shapes)
  if fields is None:
    raise ValueError(f'{path} holds no ViT parameters (no embedding/kernel); a T2T-ViT file '
                     'needs --model (e.g. T2T-ViT-14).')
  classes = fields.pop('num_classes')
  if classes is None:
    raise ValueError(f'{path} has no classification head (head/kernel): a feature extractor '
                     'cannot predict classes.')
  if num_classes is not None and int(num_classes) != classes:
    raise ValueError(f"--num-classes {num_classes} does not match {path}: its head has "
                     f"{classes} classes; drop --num-classes (the head decides).")
  if model_name is None:
    hybrid = 'resnet_num_layers' in fields
    model_name = 'R+ViT-custom' if hybrid else 'ViT-custom'
    if not hybrid:
      fields.pop('resnet_width_factor', None)
    fields.update(overrides)
  else:
    fields = dict(overrides)
    if 'params/pre_logits/kernel' in shapes and 'representation_size' not in fields:
      fields['representation_size'] = shapes['params/pre_logits/kernel'][-1]
    implied = vit_shapes.architecture_fields(shapes)
    for key in ('classifier', 'posemb'):  # What the weights compute, whatever the name says.
      fields.setdefault(key, implied[key])
  if image_size is None:
    posemb = shapes.get(checkpoint.POSEMB_KEY)
    if posemb is None:
      raise ValueError(f"{path} has no learned position table (posemb='sincos2d', which fits "
                       'any resolution): give the image size (--image-size, e.g. 224).')
    image_size = vit_shapes.image_size(shapes, vit_shapes.architecture_fields(shapes))
    if image_size is None:
      tokens = posemb[1] - (1 if 'params/cls' in shapes else 0)
      raise ValueError(f'{path} (position embedding) has {tokens} position(s), not a square '
                       'grid: give image_size (--image-size).')
  config = _official_config(model_name, classes, int(image_size),
                            normalization='minus_one_to_one', eval_crop_pct=None,
                            overrides=fields)
  return TrainedModel(config, variables, labels.official_label_names(classes),
                      classes == IMAGENET21K_CLASSES, None, path)


def _from_foreign(ckpt: checkpoint.Checkpoint, model_name: Optional[str],
                  num_classes: Optional[int], image_size: Optional[int],
                  overrides: Dict[str, Any]) -> TrainedModel:
  """A transformers or timm ViT: numerics and class names from the file, normalization from its
  ``preprocessor_config.json`` (else pixels in [-1, 1])."""
  heads = overrides.get('num_heads')
  if heads is None and model_name:
    try:
      heads = models.model_config(model_name, **overrides).get('num_heads')
    except (ValueError, TypeError):  # E.g. ViT-custom without its fields: reported later.
      heads = None
  path = ckpt.path
  foreign = ckpt.foreign(heads)
  numerics = {k: foreign.fields[k] for k in ecosystem.NUMERICS}
  trained = _from_vit_weights(path, foreign.variables, model_name, num_classes,
                              image_size or foreign.image_size, {**numerics, **overrides})
  names = foreign.label_names or trained.label_names
  normalization = _hf_normalization(ckpt.probe.hf_directory)
  config = trained.config
  if normalization:
    config = ml_collections.ConfigDict(config.to_dict())
    config.data.normalization = normalization
  return dataclasses.replace(trained, config=config, label_names=names,
                             description=f'{path} ({foreign.family})')


def _hf_normalization(directory: Optional[str]) -> Optional[str]:
  """'minus_one_to_one' or 'imagenet' from ``preprocessor_config.json``'s ``image_mean``."""
  if directory is None:  # A timm file.
    return None
  file = paths.join(directory, 'preprocessor_config.json')
  if not paths.exists(file):
    return None
  try:
    mean = [round(float(m), 3) for m in json.loads(paths.read_bytes(file)).get('image_mean', [])]
  except (ValueError, TypeError):
    return None
  return {(0.5, 0.5, 0.5): 'minus_one_to_one', (0.485, 0.456, 0.406): 'imagenet'}.get(
      tuple(mean))


def _from_torch(ckpt: checkpoint.Checkpoint, model_name: Optional[str],
                num_classes: Optional[int], image_size: Optional[int], use_ema: bool,
                overrides: Dict[str, Any]) -> TrainedModel:
  path = ckpt.path
  if not model_name:
    raise ValueError(f'{path} is a PyTorch checkpoint: name its model with --model (e.g. '
                     '--model T2T-ViT-14 or --model T2T-ViT_t-14).')
  model = models.create(model_name, num_classes=1000, **overrides)
  if not isinstance(model, models.T2TViT):
    raise ValueError(f'{path} is a PyTorch checkpoint, read as a T2T-ViT; --model '
                     f'{model_name} is not one (T2T-ViT-7/10/12/14/19/24, T2T-ViT_t-14/19/24).')
  try:
    variables = ckpt.read_for_finetuning(model, use_ema)
  except mismatch.ModelMismatchError as e:
    raise ValueError(f'{path} does not fit --model {model_name}. {e.implied or ""} Name the '
                     'model these weights are of (with --set KEY=VALUE for the fields of '
                     'T2T-ViT-custom).') from e
  return _from_t2t_variables(path, variables, model_name, num_classes, image_size, overrides)


def load(source: Any, *, step: Optional[int] = None, use_ema: bool = True,
         model_name: Optional[str] = None, num_classes: Optional[int] = None,
         image_size: Optional[int] = None, overrides: Optional[Dict[str, Any]] = None,
         devices: Optional[Sequence[Any]] = None) -> TrainedModel:
  """The :class:`TrainedModel` of ``source`` (:data:`SOURCES`, local or ``gs://``), checked to
  fit its model.

  ``step``: a workdir's (default the latest); ``use_ema``: the parameter EMA when saved;
  ``model_name``: required for ``.pth.tar`` files and T2T-ViT convert directories, checked for
  ``.npz``, refused for workdirs; ``num_classes``: checked against the head; ``image_size``:
  default the position table's; ``overrides``: model fields; ``devices``: default all.

  Raises FileNotFoundError (nothing at ``source``, no finalized step, ``step`` not saved) or
  ValueError (no known format, a damaged or unsafe file: ``DamagedCheckpointError``,
  ``UnsafePickleError``; a model that does not fit the weights, with the
  architecture they imply, a class count other than the head's, NaN or Inf values).
  """
  path = paths.normalize(source)
  if not str(path).strip():
    raise ValueError(f'No source given: give {SOURCES}.')
  if not paths.exists(path):
    raise FileNotFoundError(f'{path} does not exist: give {SOURCES}.')
  overrides = dict(overrides or {})
  ckpt = checkpoint.open(path)
  trained = _FROM[ckpt.name](ckpt, model_name=model_name, num_classes=num_classes,
                             image_size=image_size, use_ema=use_ema, overrides=overrides,
                             step=step)
  config = _for_devices(trained.config, list(jax.devices() if devices is None else devices))
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


def _from_orbax(ckpt, *, model_name, num_classes, image_size, use_ema, overrides, step):
  path = ckpt.path
  run = workdir.read_run(path, step=step)
  if run.config is not None:
    return _from_run(path, run, use_ema, model_name, overrides, num_classes, image_size)
  # A convert directory: weights, and what convert kept of their source.
  variables = orbax.read_variables(run.state_item, use_ema=use_ema)
  if models.layout.is_scanned(variables['params']):  # A scanned run's: built per layer.
    variables = models.unscan_params(variables)
  kept = orbax.read_export_metadata(run.state_item) or {}
  size = image_size or kept.get('image_size')
  if vit_shapes.architecture_fields(_shapes(variables)) is None:
    trained = _from_t2t_variables(path, variables, model_name, num_classes, size, overrides)
  else:
    trained = _from_vit_weights(path, variables, model_name, num_classes, size, overrides)
  return _with_kept(trained, kept, run.state_item)


def _from_npz(ckpt, *, model_name, num_classes, image_size, use_ema, overrides):
  return _from_vit_weights(ckpt.path, ckpt.read(), model_name, num_classes, image_size,
                           overrides)


def _one_file(read):
  """``read`` for a checkpoint file, which has no steps."""
  def with_step(ckpt, *, step, **kwargs):
    if step is not None:
      raise ValueError(f'--step applies to training workdirs; {ckpt.path} is a single '
                       'checkpoint file.')
    return read(ckpt, **kwargs)
  return with_step


#: How each checkpoint format (``vit_jax.checkpoint.formats``) becomes a TrainedModel.
_FROM = {'orbax': _from_orbax, 'npz': _one_file(_from_npz), 'pytorch': _one_file(_from_torch),
         'hf': _one_file(lambda ckpt, use_ema, **kw: _from_foreign(ckpt, **kw)),
         'timm': _one_file(lambda ckpt, use_ema, **kw: _from_foreign(ckpt, **kw))}


def _check_finite(path: str, trained: TrainedModel, use_ema: bool) -> None:
  """Raises ValueError for NaN or Inf values, naming them (and a run's newest finite step)."""
  bad = checkpoint.non_finite(trained.variables)
  if not bad:
    return
  what = f'{path} (step {trained.step})' if trained.step is not None else path
  advice = 'Use weights without them (re-export or re-download the file).'
  steps = workdir.read_run(path).steps if trained.step is not None else []  # []: a step dir.
  if steps:
    finite = next((s for s in reversed(steps) if s < trained.step and not checkpoint.non_finite(
        orbax.read_variables(workdir.find_state_item(path, s), use_ema=use_ema))), None)
    advice = (f'Give --step {finite}, the newest step whose values are finite.'
              if finite is not None else 'No earlier step of the run is finite: train it again.')
  elif trained.step is not None:
    advice = 'Give an earlier step of the run (its workdir, with --step).'
  raise ValueError(f'{checkpoint.non_finite_message(what, bad)}: its outputs would be '
                   f'meaningless. {advice}')


def _from_t2t_variables(path: str, variables: Dict[str, Any], model_name: Optional[str],
                        num_classes: Optional[int], image_size: Optional[int],
                        overrides: Dict[str, Any]) -> TrainedModel:
  """A T2T-ViT's variables (a ``.pth.tar`` or a convert directory)."""
  if not model_name:
    raise ValueError(f'{path} holds weights without a config: name the model with --model (e.g. '
                     '--model T2T-ViT-14).')
  shapes = _shapes(variables)
  classes = shapes.get('params/head/kernel', (None,))[-1]
  if classes is None or (num_classes is not None and int(num_classes) != classes):
    raise ValueError(f"--num-classes {num_classes} does not match {path}: its head has "
                     f"{classes} classes; drop --num-classes (the head decides).")
  if image_size is None:
    tokens = shapes.get('constants/pos_embed', (1, 1))[1] - 1
    image_size = _grid_side(tokens, f'{path} (pos_embed)') * 16
  config = _official_config(model_name, classes, int(image_size), normalization='imagenet',
                            eval_crop_pct=0.9, overrides=overrides)
  return TrainedModel(config, variables, labels.official_label_names(classes),
                      classes == IMAGENET21K_CLASSES, None, path)


class Runner:
  """A :class:`TrainedModel` on a device mesh: ``setup`` (``vit_jax.step.Setup``), ``state``
  (``{'params', ['model_state']}``, global arrays), ``batch_size`` (the global eval batch)."""

  def __init__(self, trained: TrainedModel, *, devices: Optional[Sequence[Any]] = None):
    self.trained = trained
    config = trained.config
    size = int(config.data.image_size)
    self.setup = step_lib.build(config, image_shape=(size, size, 3), devices=devices)
    variables = dict(trained.variables)
    state = {'params': variables.pop('params')}
    if variables:
      state['model_state'] = variables
    self.state = jax.device_put(state, self.setup.variables_shardings)
    self.batch_size = int(config.eval_batch_size)
    self._steps: Dict[str, Any] = {}
    self._compiler = step_lib.Compiler(self.setup)

  def _run(self, name: str, *args):
    if name not in self._steps:
      jitted = {'eval': lambda: self.setup.jit_eval_step(variables_only=True),
                'features': self.setup.jit_features_step,
                'logits': self._jit_logits}[name]()
      self._steps[name] = jitted
    return self._compiler(self._steps[name], self.state, *args)

  def _jit_logits(self):
    model = self.setup.model

    def logits(state, images):
      return model.apply(step_lib.variables_of(state), images, train=False)

    return jax.jit(logits, in_shardings=(self.setup.variables_shardings,
                                         self.setup.batch_sharding),
                   out_shardings=self.setup.batch_sharding)

  def _padded(self, images: np.ndarray, fn: str) -> np.ndarray:
    """Runs ``fn`` on one process's images in batches of ``batch_size``, padding the last."""
    images = np.asarray(images, np.float32)
    if images.ndim != 4 or images.shape[1:] != (self.trained.image_size,) * 2 + (3,):
      s = self.trained.image_size
      raise ValueError(f'Images of shape {images.shape}: the model takes [B, {s}, {s}, 3] '
                       '(preprocessed as its config.data says).')
    local = self.batch_size // jax.process_count()
    out = []
    for start in range(0, len(images), local):
      chunk = images[start:start + local]
      padded = np.concatenate([chunk, np.zeros((local - len(chunk),) + chunk.shape[1:],
                                               np.float32)]) if len(chunk) < local else chunk
      result = self._run(fn, self.setup.to_global(padded))
      out.append(self.setup.to_local(result)[:len(chunk)])
    width = self.trained.num_classes if fn == 'logits' else None
    return np.concatenate(out) if out else np.zeros((0, width or 0), np.float32)

  def logits(self, images: np.ndarray) -> np.ndarray:
    """float32 ``[B, S, S, 3]`` preprocessed images of this process -> ``[B, C]`` logits (raises
    ValueError for another shape)."""
    return self._padded(images, 'logits')

  def features(self, images: np.ndarray) -> np.ndarray:
    """float32 ``[B, S, S, 3]`` preprocessed images of this process -> ``[B, F]`` pre-logit
    features (``vit_jax.step.make_features_step``)."""
    return self._padded(images, 'features')

  def eval_sums(self, batch: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """The eval step's sums of one process-local batch (``{'image', 'labels', 'mask'}``), summed
    over all processes."""
    return jax.device_get(self._run('eval', self.setup.to_global(batch)))
