"""The checkpoint formats: one :class:`Checkpoint` subclass each in :data:`FORMATS`, and
:func:`open`, which detects a source's format once (nothing unpickled). A new format: a subclass
here, its text in ``rundir.ACCEPTED_FORMATS``."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Dict, Optional, Sequence, Tuple

from absl import logging
import numpy as np

from vit_jax import models
from vit_jax import rundir
from vit_jax import storage
from vit_jax.checkpoint import archive
from vit_jax.checkpoint import ecosystem
from vit_jax.checkpoint import hf_vit
from vit_jax.checkpoint import mismatch
from vit_jax.checkpoint import npz
from vit_jax.checkpoint import orbax
from vit_jax.checkpoint import saved_run
from vit_jax.checkpoint import t2t_torch
from vit_jax.checkpoint import timm_vit
from vit_jax.checkpoint import torch_pickle
from vit_jax.checkpoint import tree
from vit_jax.checkpoint import vit_shapes

ACCEPTED_FORMATS = rundir.ACCEPTED_FORMATS

#: File names read as PyTorch checkpoints (as is any zip with one '<name>/data.pkl').
TORCH_SUFFIXES = ('.pth', '.pth.tar', '.pt')


@dataclasses.dataclass
class Probe:
  """What detection read of a source: a directory's listing (``names``) or a file's first bytes
  (``head``) with its ``zip`` or safetensors ``header``; its transformers directory and listing."""
  path: str
  names: Optional[Tuple[str, ...]]
  head: bytes = b''
  zip: Optional[archive.Zip] = None
  header: Optional[archive.Header] = None
  hf_directory: Optional[str] = None
  hf_names: Tuple[str, ...] = ()


def _probe(source: Any) -> Probe:
  path, names, head = storage.probe(source, 9)
  probe = Probe(path, None if names is None else tuple(names), head)
  if names is not None:
    probe.hf_directory, probe.hf_names = hf_vit.find(path, names)
  elif archive.kind(head) == 'zip':
    probe.zip = archive.Zip.of(path)
  elif archive.kind(head) == 'safetensors' or path.endswith(archive.SAFETENSORS_SUFFIX):
    probe.header = archive.read_header(path, head)
    if hf_vit.is_hf_names(probe.header[0]):
      probe.hf_directory, probe.hf_names = hf_vit.find(path)
  return probe


@dataclasses.dataclass(frozen=True)
class Contents:
  """A checkpoint read whole to build a model from: ``variables`` (NumPy, as saved), the
  ``fields`` the shapes imply (None: not a ViT's), the ``numerics`` the file records, None where
  not recorded; weights alone get their paper's eval preprocessing (those keys in
  ``from_paper``)."""
  variables: Dict[str, Any]
  description: str
  num_classes: Optional[int] = None
  fields: Optional[Dict[str, Any]] = None
  numerics: Dict[str, Any] = dataclasses.field(default_factory=dict)
  image_size: Optional[int] = None
  label_names: Optional[Tuple[str, ...]] = None
  multi_label: Optional[bool] = None
  normalization: Optional[str] = None
  eval_crop_pct: Optional[float] = None
  run: Optional[saved_run.SavedRun] = None
  from_paper: Tuple[str, ...] = ()


def _head_classes(shapes: Dict[str, Tuple[int, ...]]) -> Optional[int]:
  return shapes.get('params/head/kernel', (None,))[-1]


def _weights_alone(variables: Dict[str, Any], description: str,
                   kept: Optional[Dict[str, Any]] = None, **recorded: Any) -> Contents:
  """Weights without a config: what the file recorded (``kept``: the model fields written
  beside them, over the shapes' reading), else their paper's evaluation (ViT: pixels in [-1, 1];
  T2T-ViT: ImageNet mean and std, a 90% centre crop, 16 px per row of its table's grid)."""
  shapes = tree.shapes(variables)
  kept = dict(kept or {})
  vit = vit_shapes.architecture_fields(shapes, recorded.get('image_size'),
                                       strict='no_embed_class' not in kept)
  if vit is not None and kept:
    vit.update(kept)
    recorded['numerics'] = {**(recorded.get('numerics') or {}), **kept}
  if vit is not None:
    paper = dict(normalization='minus_one_to_one', image_size=vit_shapes.image_size(shapes, vit))
  else:
    side = vit_shapes.square_side(shapes.get('constants/pos_embed', (1, 1))[1] - 1)
    paper = dict(normalization='imagenet', eval_crop_pct=0.9, image_size=side and side * 16)
  recorded = {k: v for k, v in recorded.items() if v is not None}
  return Contents(variables, description, _head_classes(shapes), vit, **{**paper, **recorded},
                  from_paper=tuple(k for k in paper if k not in recorded))


def _with_facts(variables: Dict[str, Any], description: str, facts: Dict[str, Any], where: str,
                fix: str) -> Contents:
  """:func:`_weights_alone` with the ``facts`` this project kept beside the weights at ``where``
  (``orbax.EXPORT_FACTS`` and ``model``); ``fix``: of class names that do not fit the head."""
  names = _check_names(facts.get('label_names'), _head_classes(tree.shapes(variables)), where, fix)
  recorded = {k: facts.get(k) for k in orbax.EXPORT_FACTS}
  return _weights_alone(variables, description, vit_shapes.from_kept(facts.get('model')),
                        **{**recorded, 'label_names': names})


def _check_names(names: Optional[Sequence[str]], num_classes: Optional[int], where: str,
                 fix: str) -> Optional[Tuple[str, ...]]:
  """``names`` as a tuple; ValueError when they are not one per output of the head."""
  if names and num_classes and len(names) != num_classes:
    raise ValueError(f'{where} names {len(names)} classes, but the model\'s head has '
                     f'{num_classes} outputs: the names are not this model\'s; {fix}.')
  return tuple(str(n) for n in names) if names else None


@dataclasses.dataclass
class Checkpoint:
  """A checkpoint opened by :func:`open`, of its format's class in :data:`FORMATS`. ``name``:
  the format's (:func:`detect`); ``family``: for messages; ``has_steps``: a run's steps;
  ``reads_with_model``: the model's name and fields shape the reading."""
  path: str
  probe: Probe
  name = family = ''
  has_steps = reads_with_model = False

  def sniff(self) -> bool:
    """Whether ``probe`` is of this format (nothing unpickled)."""
    raise NotImplementedError

  def shapes(self) -> Dict[str, Tuple[int, ...]]:
    return tree.shapes(self.read())

  def fields(self, num_heads: Optional[int] = None) -> Dict[str, Any]:
    """:func:`vit_jax.checkpoint.model_fields`. Here the architecture from the shapes, then the
    fields kept beside them (:meth:`kept`), else the official numerics."""
    shapes = self.shapes()
    kept, size = self.kept()
    fields = vit_shapes.architecture_fields(shapes, size, strict='no_embed_class' not in kept)
    if fields is None:
      raise ValueError(f'{self.path} holds no ViT parameters (no embedding/kernel).')
    fields.update(gelu_approximate=True, layer_norm_epsilon=models.vit.LAYERNORM_EPSILON)
    fields.update(kept)
    fields['image_size'] = vit_shapes.image_size(shapes, fields)
    return fields

  def _facts(self) -> Dict[str, Any]:
    """What this project wrote beside the weights (``model`` and ``orbax.EXPORT_FACTS``)."""
    return {}

  def kept(self) -> Tuple[Dict[str, Any], Optional[int]]:
    """The model fields this project wrote beside the weights (``vit_shapes.KEPT_FIELDS``;
    ``{}``: none) and the image size it recorded (or None)."""
    facts = self._facts()
    return vit_shapes.from_kept(facts.get('model')), facts.get('image_size')

  def numerics(self, num_heads: Optional[int] = None) -> Optional[Tuple[Dict[str, Any], str]]:
    """``(numerics fields, family)`` from the headers and config only, or None where the format
    records none; here the :meth:`kept` ones."""
    kept = self.kept()[0]
    wanted = ecosystem.NUMERICS + ecosystem.RESAMPLING
    return ({k: kept[k] for k in wanted if k in kept}, self.family) if kept else None

  def table_grid(self, shapes: Dict[str, Tuple[int, ...]]) -> Optional[Tuple[int, int]]:
    """The ``(rows, columns)`` token grid the learned position table in ``shapes`` (of what
    :meth:`read` gave) was made for, where the checkpoint records an image size, else None."""
    return None

  def read(self, *, model: Any = None, use_ema: bool = True, image_size: Any = None,
           evaluate: bool = True) -> Dict[str, Any]:
    """The variables (:func:`vit_jax.checkpoint.load`); with ``model`` and an image size (given,
    or the file's) and ``evaluate``, checked to fit ``model``, else as saved."""
    raise NotImplementedError

  def _fitted(self, variables: Dict[str, Any], model: Any, image_size: Any,
              evaluate: bool) -> Dict[str, Any]:
    """``variables``, checked to fit ``model`` at ``image_size`` when given and ``evaluate``."""
    if model is not None and image_size is not None and evaluate:
      size = (image_size, image_size) if isinstance(image_size, int) else image_size
      tree.check_fits(variables, models.abstract_variables(model, size), what=self.path)
    return variables

  def read_for_finetuning(self, model: Any, use_ema: bool = True) -> Dict[str, Any]:
    """The variables at the file's own class count and size, for ``init_for_finetuning``."""
    return self.read(model=model, use_ema=use_ema, evaluate=False)

  def contents(self, *, use_ema: bool = True, step: Optional[int] = None,
               model_name: Optional[str] = None,
               overrides: Optional[Dict[str, Any]] = None) -> Contents:
    """What a model is built from: ``step`` of a run (default the latest; ValueError for a
    file), ``model_name`` and ``overrides`` (``models.create`` fields) for a PyTorch file (and
    a timm file's heads). Raises as :meth:`read`; ValueError for class names that do not fit."""
    if step is not None and not self.has_steps:
      raise ValueError(f'--step applies to training workdirs; {self.path} is {self.family}, '
                       'which has no steps.')
    return self._contents(use_ema, step, model_name, dict(overrides or {}))

  def _contents(self, use_ema: bool, step: Optional[int], model_name: Optional[str],
                overrides: Dict[str, Any]) -> Contents:
    return _weights_alone(self.read(use_ema=use_ema, evaluate=False), self.path)


class _Npz(Checkpoint):
  name = 'npz'
  family = 'an official .npz'

  def sniff(self):
    return self.probe.zip is not None

  def shapes(self):  # From the .npy headers: no array is read.
    return npz.read_npz_shapes(self.path, self.probe.zip)[0]

  def _facts(self):  # The JSON file beside (npz.fields_path).
    return npz.read_npz_facts(self.path)

  def numerics(self, num_heads=None):
    shapes, big_vision = npz.read_npz_shapes(self.path, self.probe.zip)
    fields = vit_shapes.architecture_fields(shapes, strict=False)
    if fields is None:  # Not a ViT's .npz: left to the load's checks.
      return None
    found = {k: fields[k] for k in ('posemb', 'classifier')}
    found.update((super().numerics(num_heads) or ({},))[0])
    return found, 'a big_vision .npz' if big_vision else self.family

  def _contents(self, use_ema, step, model_name, overrides):
    facts = self._facts()
    return _with_facts(self.read(use_ema=use_ema, evaluate=False), self.path, facts,
                       npz.fields_path(self.path), 'restore the file, or delete it')

  def read(self, *, model=None, use_ema=True, image_size=None, evaluate=True):
    return self._fitted(npz.load_npz(self.path, self.probe.zip), model, image_size, evaluate)


class _PyTorch(Checkpoint):
  """T2T-ViT state dicts (:func:`.torch_pickle.load_pth`), converted for a model."""
  name = 'pytorch'
  family = 'a PyTorch T2T-ViT checkpoint'
  reads_with_model = True

  def sniff(self):
    if self.probe.zip is not None:
      return torch_pickle.has_torch_layout(self.probe.zip.names)
    return self.probe.names is None and (self.path.lower().endswith(TORCH_SUFFIXES)
                                         or archive.kind(self.probe.head) == 'pickle')

  def fields(self, num_heads=None):
    raise ValueError(f'{self.path} is a PyTorch (T2T-ViT) checkpoint: its variant is not '
                     'recorded; name the model (e.g. T2T-ViT-14).')

  def read(self, *, model=None, use_ema=True, image_size=None, evaluate=True):
    path = self.path
    if model is None:
      raise ValueError(
          f'{path!r} is a PyTorch checkpoint: converting it into Flax variables needs the '
          'model. Pass model= (e.g. load(path, model=vit_jax.models.create("T2T-ViT-14", '
          'num_classes=1000))), or use vit_jax.checkpoint.load_pth(path) for the raw PyTorch '
          'state dict (names -> np.ndarray).')
    if not isinstance(model, models.T2TViT):
      raise ValueError(f'{path!r} is a PyTorch checkpoint: only T2T-ViT models '
                       f'(vit_jax.models.t2t.T2TViT) load those, not {type(model).__name__}.')
    state_dict = torch_pickle.load_pth(path, use_ema=use_ema, zip_file=self.probe.zip)
    head = [np.shape(v)[0] for k, v in state_dict.items()
            if k.split('.')[-2:] == ['head', 'weight']]
    if not evaluate and head:  # As saved: the file's class count (and, by default, input size).
      model = model.clone(num_classes=int(head[0]))
    return t2t_torch.from_torch_state_dict(state_dict, model, image_size=image_size)

  def _contents(self, use_ema, step, model_name, overrides):
    path = self.path
    if not model_name:
      raise ValueError(f'{path} is a PyTorch checkpoint: name its model with --model (e.g. '
                       '--model T2T-ViT-14 or --model T2T-ViT_t-14).')
    if 'num_classes' in overrides:
      raise ValueError('--set num_classes: the class count (and the input size) are read from '
                       "the file's head.weight and pos_embed; drop it.")
    model = models.create(model_name, num_classes=1000, **overrides)
    if not isinstance(model, models.T2TViT):
      raise ValueError(f'{path} is a PyTorch checkpoint, read as a T2T-ViT; --model '
                       f'{model_name} is not one (T2T-ViT-7/10/12/14/19/24, T2T-ViT_t-14/19/24).')
    try:
      variables = self.read_for_finetuning(model, use_ema)
    except mismatch.ModelMismatchError as e:
      raise ValueError(f'{path} does not fit --model {model_name}. {e.implied or ""} Name the '
                       'model these weights are of (with --set KEY=VALUE for the fields of '
                       'T2T-ViT-custom).') from e
    return _weights_alone(variables, path)


class _Orbax(Checkpoint):
  name = 'orbax'
  family = 'an Orbax checkpoint'
  has_steps = True

  def sniff(self):
    return self.probe.names is not None

  def read(self, *, model=None, use_ema=True, image_size=None, evaluate=True):
    item = (self.path if orbax.is_item(self.path, self.probe.names)
            else saved_run.find_state_item(self.path, names=self.probe.names))
    return self._fitted(orbax.read_variables(item, use_ema=use_ema), model, image_size,
                        evaluate)

  def _facts(self):  # A convert directory's (orbax.EXPORT_JSON); a run's config is read apart.
    run = saved_run.read_run(self.path)
    return {} if run.config is not None else orbax.read_export_metadata(run.state_item) or {}

  def table_grid(self, shapes):
    run = saved_run.read_run(self.path)
    if run.config is None:  # A convert directory: the image size its source recorded, if any.
      size = (orbax.read_export_metadata(run.state_item) or {}).get('image_size')
      return vit_shapes.token_grid(size, vit_shapes.architecture_fields(shapes))
    model = run.config.get('model') or {}
    if model.get('posemb_grid'):
      return tuple(int(g) for g in model['posemb_grid'])
    return vit_shapes.token_grid((run.config.get('data') or {}).get('image_size'), model)

  def _contents(self, use_ema, step, model_name, overrides):
    run = saved_run.read_run(self.path, step=step)
    variables = orbax.read_variables(run.state_item, use_ema=use_ema)
    if run.config is None:  # A convert directory: what convert kept of its source.
      return _with_facts(variables, self.path, orbax.read_export_metadata(run.state_item) or {},
                         storage.join(run.state_item, orbax.EXPORT_JSON),
                         'restore the file, or delete it (then 1,000 or 21,843 classes get the '
                         'official ImageNet names, others their numbers)')
    data = run.config.get('data') or {}
    names, multi_label = _label_names(run.dataset, int(run.config['num_classes']), run)
    weights = 'EMA parameters' if use_ema and run.has_ema else 'parameters'
    if multi_label is None:
      multi_label = run.config.get('loss') == 'sigmoid_xent'
    return Contents(
        variables, f'{self.path} (step {run.step}, {weights})', int(run.config['num_classes']),
        image_size=data.get('image_size'),
        label_names=names, normalization=data.get('normalization'),
        multi_label=multi_label, eval_crop_pct=data.get('eval_crop_pct'), run=run)


def _label_names(dataset: Optional[Dict[str, Any]], num_classes: int, run: saved_run.SavedRun
                 ) -> Tuple[Optional[Tuple[str, ...]], Optional[bool]]:
  """The class names and multi-label flag of a run's dataset record. Raises ValueError: it names
  another number of classes than the head has."""
  if not dataset:
    return None, None
  record, of_step = run.dataset_source()
  where, fix = ((f'The dataset record of step {run.step} ({record})',
                 'the checkpoint is inconsistent: use another step (--step)') if of_step else
                (f'The dataset record {record}', f'restore this run\'s {record}, or delete it '
                 '(the names then come from the training data, when it is on this machine)'))
  return (_check_names(dataset.get('label_names'), num_classes, where, fix),
          dataset.get('multi_label'))


class _Foreign(Checkpoint):
  """transformers or timm ViT weights, whose numerics the files record; ``_weights(num_heads,
  gelu_approximate, no_embed_class)`` gives ``(params, fields with image_size, class names or
  None)`` (the arguments: the model's, for a file that does not record them)."""

  def numerics(self, num_heads=None):
    return self.fields(num_heads), self.family

  def _weights_for(self, model: Any) -> Tuple[Dict[str, Any], Dict[str, Any], Any]:
    return self._weights(*(getattr(model, k, None)
                           for k in ('num_heads', 'gelu_approximate', 'no_embed_class')))

  def read(self, *, model=None, use_ema=True, image_size=None, evaluate=True):
    params, fields, _ = self._weights_for(model)
    if model is not None and evaluate:
      ecosystem.check_numerics(fields, model, self.path)
    return self._fitted({'params': params}, model, image_size or fields['image_size'],
                        evaluate)

  def _contents(self, use_ema, step, model_name, overrides):
    heads = overrides.get('num_heads')
    if heads is None and model_name:
      with contextlib.suppress(ValueError, TypeError):  # Reported later (e.g. ViT-custom).
        heads = models.model_config(model_name, **overrides).get('num_heads')
    params, fields, names = self._weights(heads, overrides.get('gelu_approximate'),
                                          overrides.get('no_embed_class'))
    return _weights_alone(
        {'params': params}, f'{self.path} ({self.family.removeprefix("a ")})',
        numerics={k: fields[k] for k in ecosystem.NUMERICS}, image_size=fields['image_size'],
        label_names=names, **self._preprocessing())

  def _preprocessing(self) -> Dict[str, Any]:
    """The eval preprocessing the files record (``normalization``, ``eval_crop_pct``)."""
    return {}

  def read_for_finetuning(self, model, use_ema=True):
    params, fields, _ = self._weights_for(model)
    try:
      ecosystem.check_numerics(fields, model, self.path)
    except ValueError as e:
      logging.warning('Fine-tuning with other numerics than the weights were trained with: %s',
                      e)
    return {'params': params}


class _Hf(_Foreign):
  name = 'hf'
  family = 'a transformers ViT'

  def sniff(self):
    probe = self.probe
    if (probe.hf_directory is None and probe.header is not None
        and hf_vit.is_hf_names(probe.header[0])):
      raise ValueError(f'{probe.path} holds transformers ViT weights but no config.json lies '
                       'beside it: keep the directory save_pretrained wrote (or the Hub '
                       'repository) together, and give the directory.')
    return probe.hf_directory is not None

  def fields(self, num_heads=None):
    return hf_vit.read_fields(self.probe.hf_directory, self.probe.hf_names)

  def table_grid(self, shapes):
    return vit_shapes.token_grid(hf_vit.read_config(self.probe.hf_directory).get('image_size'),
                                 vit_shapes.architecture_fields(shapes))

  def _weights(self, num_heads, gelu_approximate=None, no_embed_class=None):  # config.json's.
    return hf_vit.read(self.probe.hf_directory, self.probe.hf_names)

  def _preprocessing(self):
    return {'normalization': hf_vit.normalization(self.probe.hf_directory, self.probe.hf_names)}


class _Timm(_Foreign):
  name = 'timm'
  family = 'a timm ViT'
  reads_with_model = True  # Heads, GELU: the model's.

  def sniff(self):
    return self.probe.header is not None and timm_vit.is_timm_names(self.probe.header[0])

  def fields(self, num_heads=None, strict=True):
    header = self.probe.header
    return timm_vit.fields_from(archive.shapes(header), header[1], self.path, num_heads,
                                strict=strict)

  def numerics(self, num_heads=None):  # Whatever the table's layout (not named here).
    fields = self.fields(num_heads, strict=False)
    layout = ('image_size', 'no_embed_class')
    return {k: v for k, v in fields.items() if k not in layout}, self.family

  def _weights(self, num_heads, gelu_approximate=None, no_embed_class=None):
    return timm_vit.read(self.path, self.probe.header, num_heads, gelu_approximate,
                         no_embed_class)

  def _preprocessing(self):
    return timm_vit.preprocessing(self.path, self.probe.header[1])

  def _contents(self, use_ema, step, model_name, overrides):
    contents = super()._contents(use_ema, step, model_name, overrides)
    if 'normalization' in contents.from_paper:  # Said once, wherever images are preprocessed.
      logging.warning('%s', timm_vit.ASSUMED_PREPROCESSING.format(path=self.path))
    return contents


#: Every format, in detection order (a torch zip before any zip, transformers before Orbax).
FORMATS = (_Hf, _Timm, _PyTorch, _Npz, _Orbax)


def open(source: Any) -> Checkpoint:  # pylint: disable=redefined-builtin
  """Detects the format of the checkpoint at ``source`` (local, ``scheme://`` or a Hub name,
  ``hf-hub:ORG/NAME[@REVISION]``: ``storage.normalize``), once. Raises FileNotFoundError
  (nothing at ``source``; a Hub name not cached while offline), DamagedCheckpointError (a zip or
  safetensors file whose directory or header cannot be read) and ValueError (no accepted format,
  e.g. a ``.npy`` file, another model's ``.safetensors``, or one without its ``config.json``)."""
  probe = _probe(source)
  path = probe.path
  for ckpt in (fmt(path, probe) for fmt in FORMATS):
    if ckpt.sniff():
      return ckpt
  if probe.header is not None:
    shown = ', '.join(sorted(probe.header[0])[:4])
    raise ValueError(f'{path} is a .safetensors file of neither a transformers ViT nor a timm '
                     f'VisionTransformer (its tensors: {shown}, ...).')
  if archive.kind(probe.head) == 'npy':
    raise ValueError(f'{path!r} is a single-array .npy file, not a checkpoint. Accepted '
                     f'formats: {ACCEPTED_FORMATS}')
  raise ValueError(f'Unrecognised checkpoint format at {path!r}. Accepted formats: '
                   f'{ACCEPTED_FORMATS}')


def detect(path: Any) -> str:
  """The format name of the checkpoint at ``path`` (:func:`open`'s ``name``); raises as it."""
  return open(path).name


def is_torch_checkpoint(path: Any) -> bool:
  """Whether the file at ``path`` is read as a PyTorch checkpoint; raises OSError for a missing
  file or a directory, DamagedCheckpointError for a zip whose directory cannot be read."""
  probe = _probe(path)
  if probe.names is not None:
    raise IsADirectoryError(probe.path)
  return _PyTorch(probe.path, probe).sniff()
