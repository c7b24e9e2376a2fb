"""Orbax PyTree items (a directory holding ``_METADATA``): model variables read as NumPy,
checked against a run's state, written. An item is the ``state`` of a training checkpoint
(``{'step', 'params', 'opt_state', 'model_state'[, 'ema_params']}``) or a variables checkpoint
``{'params', 'model_state'}`` (:func:`save_orbax`); where items sit in a run: :mod:`.workdir`."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
from collections.abc import Mapping
from typing import Any, Dict, Optional, Sequence

import jax
import numpy as np

import vit_jax

from vit_jax import rundir
from vit_jax import storage
from vit_jax.checkpoint import durable
from vit_jax.checkpoint.mismatch import ModelMismatchError, diff, mismatch_report
from vit_jax.checkpoint.tree import describe_architecture, flatten_params
from vit_jax.models import layout


def import_orbax():
  """``orbax.checkpoint``, imported (0.3 s; not for ``.npz``) with TensorStore's Cloud Storage
  retries set from the ``GCS_RETRY_CONFIG_*`` variables (:data:`vit_jax.GCS_RETRY_DEFAULTS`).
  Orbax builds each TensorStore context from two module dicts and offers no other hook."""
  # pylint: disable=g-import-not-at-top,protected-access
  import orbax.checkpoint as ocp_lib
  from orbax.checkpoint._src.serialization import tensorstore_utils
  values = vit_jax.gcs_retries()
  retries = {'max_retries': values['MAX_RETRIES'],
             'initial_delay': f"{values['INIT_DELAY_TIME_US']}us",
             'max_delay': f"{values['MAX_DELAY_TIME_US']}us"}
  for context in (tensorstore_utils._BASE_TS_CONTEXT, tensorstore_utils._DEFAULT_OCDBT_TS_CONTEXT):
    context['gcs_request_retries'] = retries
  return ocp_lib


def is_item(path: str, names: Optional[Sequence[str]] = None) -> bool:
  """Whether ``path`` (local or ``scheme://``; ``names``: its listing, when read) is an Orbax
  PyTree item directory."""
  if names is not None:
    return rundir.ITEM_MARKER in names
  return storage.exists(storage.join(path, rundir.ITEM_MARKER)) and storage.isdir(path)


@contextlib.contextmanager
def _quiet_item_reads():
  # Reading an item on its own, Orbax looks for the step's _CHECKPOINT_METADATA in the item
  # directory and warns that it is missing; that file is one level up and not needed here.
  quiet = lambda record: 'Metadata file does not exist' not in record.getMessage()
  logging.getLogger('absl').addFilter(quiet)
  try:
    yield
  finally:
    logging.getLogger('absl').removeFilter(quiet)


def item_tree(item: Any) -> Any:
  """The metadata tree of an item: its nested structure with shape/dtype leaves (no arrays);
  None where Orbax finds no item metadata (an empty or cut step)."""
  ocp = import_orbax()
  with _quiet_item_reads():
    metadata = ocp.PyTreeCheckpointer().metadata(item)
  return getattr(metadata.item_metadata, 'tree', None)


def read_variables(item: Any, *, use_ema: bool = True) -> Dict[str, Any]:
  """``{'params': ..., **model_state}`` of one item (local or ``gs://``) as NumPy, in the
  saved layout, without the optimizer state; ``use_ema``: ``ema_params`` as ``params`` when
  saved. Raises ValueError: no ``params`` entry, or a ``params`` collection in ``model_state``."""
  ocp = import_orbax()
  tree = item_tree(item)
  if not isinstance(tree, Mapping) or 'params' not in tree:
    keys = sorted(tree) if isinstance(tree, Mapping) else type(tree).__name__
    raise ValueError(f'Orbax checkpoint {str(item)!r} has no "params" entry (top level: {keys}): '
                     'it is neither a training checkpoint nor a variables checkpoint of vit_jax.')
  params_key = 'ema_params' if use_ema and isinstance(tree.get('ema_params'), Mapping) else 'params'
  wanted = {params_key: tree[params_key]}
  if isinstance(tree.get('model_state'), Mapping):
    wanted['model_state'] = tree['model_state']
  restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), wanted)
  with _quiet_item_reads():
    restored = ocp.PyTreeCheckpointer().restore(
        item, args=ocp.args.PyTreeRestore(item=wanted, restore_args=restore_args,
                                          partial_restore=True))
  model_state = layout.to_dict(restored.get('model_state') or {})
  if 'params' in model_state:
    raise ValueError(f'{str(item)!r}: model_state must not contain a "params" collection')
  return {'params': layout.to_dict(restored[params_key]), **model_state}


def check_state_fits(state_dir: Any, abstract_state: Mapping) -> None:
  """Compares the ``params`` and ``model_state`` shapes of the ``state`` item ``state_dir``
  (metadata only) with ``abstract_state``. Raises ModelMismatchError where they differ (with
  the checkpoint's model, or the ``scan`` setting); FileNotFoundError without readable metadata
  (an empty or incomplete step)."""
  tree = item_tree(state_dir)
  if not isinstance(tree, Mapping):
    raise FileNotFoundError(errno.ENOENT, 'its metadata cannot be read', str(state_dir))
  as_structs = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(x.shape), x.dtype), t)
  kept = ('params', 'model_state')
  saved_tree = {k: as_structs(v) for k, v in tree.items() if k in kept and isinstance(v, Mapping)}
  flat = lambda t: dict(sorted(flatten_params(t).items()))
  saved = flat(saved_tree)
  wanted = flat({k: v for k, v in abstract_state.items() if k in kept})
  missing, unexpected, mismatched = diff(saved, wanted, ('saved', 'this run'))
  if not (missing or unexpected or mismatched):
    return
  # With the fixed tables ('model_state'): they tell a Performer T2T module from a Transformer.
  described = describe_architecture(saved_tree) if 'params' in saved_tree else None
  header = f'The checkpoint {state_dir} does not fit this model:'
  scanned = lambda keys: any(f'/{p}/' in k for k in keys for p in layout.BLOCK_PREFIXES)
  if saved and wanted and scanned(saved) != scanned(wanted):
    block_layout = 'scanned' if scanned(saved) else 'per-layer'
    header += (f' it was written with the {block_layout} '
               f'block layout: resume with --config.model.scan={scanned(saved)} (the training '
               f'default is True).')
  raise ModelMismatchError(mismatch_report(header, missing, unexpected, mismatched, described),
                           described)


#: The JSON file a variables checkpoint of :func:`save_orbax` keeps beside its arrays, inside
#: the item directory: what the arrays do not say (class names, preprocessing).
EXPORT_JSON = 'vit_jax_export.json'
#: What it keeps of the source, when the source records them (``checkpoint.Contents``'s names).
EXPORT_FACTS = ('label_names', 'multi_label', 'normalization', 'eval_crop_pct', 'image_size')


def save_orbax(path: Any, variables: Mapping, *, overwrite: bool = False,
               metadata: Optional[Mapping[str, Any]] = None) -> None:
  """Writes ``{'params': ..., **collections}`` (boxed or plain) as an Orbax item at ``path``
  (local: moved into place whole; or ``gs://``): ``params``, the other collections in
  ``model_state``, and JSON-able ``metadata`` in :data:`EXPORT_JSON`. Raises ValueError (no
  ``params``), FileExistsError (``path`` exists and not ``overwrite``), OSError."""
  ocp = import_orbax()
  variables = layout.unbox(variables)  # Plain arrays (model.init boxes them with axis names).
  if not isinstance(variables, Mapping) or 'params' not in variables:
    raise ValueError("save_orbax expects variables {'params': ..., **collections}.")
  path = os.fspath(path)
  target = storage.Path(path)
  if target.exists() and not overwrite:
    raise FileExistsError(f'{path} exists; choose a new destination or pass overwrite=True.')
  tree = {'params': variables['params']}
  extra = {k: v for k, v in variables.items() if k != 'params'}
  if extra:
    tree['model_state'] = dict(sorted(extra.items()))
  facts = None if metadata is None else json.dumps(dict(metadata), indent=1) + '\n'
  remote = storage.is_remote(path)  # Objects: no directory to rename.
  staging = target if remote else target.parent / f'{target.name}.partial'
  try:
    with ocp.StandardCheckpointer() as checkpointer:  # (A killed conversion's is replaced.)
      checkpointer.save(staging, tree, force=overwrite or not remote)
    if facts is not None:
      durable.write_atomically(staging / EXPORT_JSON, facts)
    if not remote:
      durable.move_into_place(staging, target)
  except BaseException:
    if not remote:
      shutil.rmtree(staging, ignore_errors=True)
    raise


def read_export_metadata(item: Any) -> Optional[Dict[str, Any]]:
  """The ``metadata`` :func:`save_orbax` kept with an item, or None; ValueError (named, with
  the fix) for a file that is not a JSON object."""
  return rundir.read_json(storage.join(storage.normalize(item), EXPORT_JSON), fix=(
      'restore it, or delete it (the class names and preprocessing are then the defaults of the '
      'weights)'))


def read_json_item(item: Any) -> Any:
  """The value of a JSON item of a checkpoint step (Orbax's ``JsonSave``, e.g. ``config``);
  ValueError naming an item that cannot be read."""
  ocp = import_orbax()
  try:
    with _quiet_item_reads():
      return ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(item)
  except Exception as e:  # pylint: disable=broad-except  (orbax/tensorstore errors vary)
    raise ValueError(f'Cannot read the checkpoint item {str(item)!r}: '
                     f'{storage.first_line(e)}') from e
