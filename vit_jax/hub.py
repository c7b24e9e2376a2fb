"""Hub names: ``hf-hub:ORG/NAME[@REVISION]`` (timm's spelling) resolved to local files through
``huggingface_hub`` and its cache, once per process (:func:`vit_jax.storage.normalize` calls
:func:`resolve`; this module imports nothing of vit_jax). Only the files resolved are downloaded;
offline the cache answers."""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Dict, Iterator, Optional, Tuple

from absl import logging

#: The prefix of a Hub name (timm's spelling).
PREFIX = 'hf-hub:'

#: A Hub model id, ``ORG/NAME`` (letters, digits, '-', '_', '.'), and an optional ``@REVISION``.
_NAME = re.compile(r'(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<revision>[^@\s]+))?')
#: The weights timm reads by default (timm/models/_hub.py: HF_SAFE_WEIGHTS_NAME first).
_TIMM_WEIGHTS = ('model.safetensors', 'pytorch_model.bin')
#: The .safetensors twin of a .bin that timm reads first (timm/models/_hub.py:
#: _get_safe_alternatives; another name.bin: name.safetensors).
_SAFE_TWINS = {'pytorch_model.bin': 'model.safetensors',
               'open_clip_pytorch_model.bin': 'open_clip_model.safetensors'}
#: transformers' weights: one file, or an index naming its shards.
_HF_WEIGHTS = 'model.safetensors'
_HF_INDEX = 'model.safetensors.index.json'
#: Resolved names: (name, cache directory, offline) -> local path.
_RESOLVED: Dict[Tuple[str, str, bool], str] = {}


def parse(name: str) -> Tuple[str, Optional[str]]:
  """``'hf-hub:timm/vit_small_patch14_dinov2.lvd142m@main'`` -> ``(repo id, revision or
  None)``. ValueError naming the form for anything else."""
  match = _NAME.fullmatch(name[len(PREFIX):])
  if not match or '..' in match['repo'] or '--' in match['repo']:
    raise ValueError(f'{name!r} is not a Hub name: write hf-hub:ORG/NAME or '
                     'hf-hub:ORG/NAME@REVISION (e.g. '
                     'hf-hub:timm/vit_small_patch14_dinov2.lvd142m).')
  return match['repo'], match['revision']


def download_command(name: str) -> str:
  """The shell command (huggingface_hub's ``hf``) that puts ``name`` in the cache."""
  repo, revision = parse(name)
  return f'hf download {repo}' + (f' --revision {revision}' if revision else '')


def resolve(name: str) -> str:
  """The local path of the Hub name ``name``, downloaded into the cache if missing: a timm
  repository's weights file (as timm chooses it), a transformers repository's snapshot directory.

  Raises:
    ValueError: not a Hub name, or a repository with neither layout.
    FileNotFoundError: not in the cache and the Hub not reached (offline, no network), naming
      the download command; no such repository, revision or file on the Hub.
    PermissionError: a gated or private repository without a token that opens it.
  """
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top  (a second)
  key = (name, str(constants.HF_HUB_CACHE), bool(constants.HF_HUB_OFFLINE))
  if key not in _RESOLVED:
    _RESOLVED[key] = _resolve(name)
  return _RESOLVED[key]


def _resolve(name: str) -> str:
  config_path = _get(name, 'config.json')
  if config_path is None:
    raise ValueError(f'{name}: the repository has no config.json, so it is neither a timm nor a '
                     'transformers model repository.')
  config = _read_config(name, config_path)
  if 'model_type' in config:  # transformers: the directory, with its weights.
    weights = _first(name, (_HF_WEIGHTS, _HF_INDEX))
    if weights.endswith(_HF_INDEX):
      for shard in sorted(set(_read_config(name, weights).get('weight_map', {}).values())):
        if _get(name, shard) is None:
          raise ValueError(f'{name}: {_HF_INDEX} names {shard}, which the repository lacks.')
    found = os.path.dirname(config_path)
  else:  # timm: its weights file, chosen as timm chooses it.
    pretrained_cfg = config.get('pretrained_cfg')
    filename = pretrained_cfg.get('hf_hub_filename') if isinstance(pretrained_cfg, dict) else None
    choices = _TIMM_WEIGHTS
    if isinstance(filename, str) and filename.endswith('.bin'):
      choices = (_SAFE_TWINS.get(filename, filename[:-len('.bin')] + '.safetensors'), filename)
    found = _first(name, choices)
  logging.info('%s is %s.', name, found)
  return found


def _first(name: str, choices: Tuple[str, ...]) -> str:
  """The path of the first of the files ``choices`` of ``name`` that the repository has (cached:
  offline, the first cached one). Errors as :func:`resolve`."""
  not_cached = None
  for filename in choices:
    try:
      found = _get(name, filename)
    except _NotCached as e:
      not_cached = not_cached or e
      continue
    if found is not None:
      return found
  if not_cached is not None:
    raise not_cached
  raise ValueError(f'{name}: the repository holds none of {", ".join(choices)}.')


@contextlib.contextmanager
def _quiet_retries() -> Iterator[None]:
  """huggingface_hub's warning per failed request and retry unsaid."""
  from huggingface_hub.utils import logging as hf_logging  # pylint: disable=g-import-not-at-top
  logger = hf_logging.get_logger('huggingface_hub.utils._http')
  level = logger.level
  logger.setLevel(hf_logging.ERROR)
  try:
    yield
  finally:
    logger.setLevel(level)


class _NotCached(FileNotFoundError):
  """A file of a Hub name that is not in the cache while the Hub cannot be asked."""


def _read_config(name: str, path: str) -> dict:
  """The JSON object of the file ``path`` of ``name``; ValueError naming it otherwise."""
  try:
    with open(path, 'rb') as f:
      value = json.loads(f.read(1 << 24))
  except (OSError, ValueError, RecursionError) as e:  # json's decoder recurses on deep nesting.
    raise ValueError(f'{name}: {os.path.basename(path)} cannot be read as JSON ({e}); '
                     f'download it again: {download_command(name)} --force-download.') from e
  if not isinstance(value, dict):
    raise ValueError(f'{name}: {os.path.basename(path)} holds no JSON object.')
  return value


def _get(name: str, filename: str) -> Optional[str]:
  """The cached path of ``filename`` of ``name`` (downloaded unless offline), or None when the
  repository (at its revision) has no such file. Errors as :func:`resolve`."""
  import huggingface_hub  # pylint: disable=g-import-not-at-top
  from huggingface_hub import constants  # pylint: disable=g-import-not-at-top
  from huggingface_hub import errors  # pylint: disable=g-import-not-at-top
  repo, revision = parse(name)
  try:
    with _quiet_retries():
      return huggingface_hub.hf_hub_download(repo, filename, revision=revision)
  except errors.LocalEntryNotFoundError as e:  # Not cached, and the Hub not asked or answering.
    why = ('HF_HUB_OFFLINE is set' if constants.HF_HUB_OFFLINE
           else 'the Hub could not be reached')
    raise _NotCached(
        f'{name} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}: no {filename}) '
        f'and {why}: download it first, on a machine with a network: {download_command(name)} '
        '(HF_HOME or HF_HUB_CACHE names the cache).') from e
  except errors.EntryNotFoundError:  # The repository has no such file.
    return None
  except errors.GatedRepoError as e:
    raise PermissionError(f'{name}: the repository is gated or private: accept its terms on '
                          f'the Hub and log in (hf auth login), then rerun.') from e
  except errors.RepositoryNotFoundError as e:
    raise FileNotFoundError(f'{name}: no model repository {repo} on the Hub (or it is private: '
                            'hf auth login). Check the name.') from e
  except errors.RevisionNotFoundError as e:
    raise FileNotFoundError(f'{name}: the repository {repo} has no revision {revision!r}: give '
                            'a branch, tag or commit of it.') from e
