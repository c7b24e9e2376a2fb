"""Converts model checkpoints between formats: ``python -m vit_jax.convert SRC DST``.

Reads any of ``vit_jax.checkpoint.ACCEPTED_FORMATS`` and writes

* a **directory** ``DST``: an Orbax checkpoint of ``{'params': ..., 'model_state': {...}}`` (the
  fixed tables of T2T-ViT go in ``model_state``), the format of this project's training
  checkpoints without the optimizer state. ``vit_jax.checkpoint.load(DST)`` restores it and
  ``--config.init_from=DST`` fine-tunes from it. ``DST/vit_jax_export.json`` keeps what the
  arrays do not say: the source's class names and eval preprocessing (a training run's, a
  transformers or timm file's), which predict, evaluate and a later convert read back;
* a file ending in ``.npz``: the official ViT layout (flat ``/``-joined Linen names,
  ``encoderblock_{i}``), for models with parameters only (ViT; a T2T-ViT needs its fixed tables,
  so write it to a directory);
* with ``--to timm``: a timm ``VisionTransformer`` ``.safetensors`` file, and the
  ``timm.create_model(...)`` call that loads it with no code (printed, and kept in the file's
  metadata); with ``--to hf``: a transformers ViT directory (``model.safetensors`` and
  ``config.json``, class names in ``id2label``) that ``ViTForImageClassification.from_pretrained``
  loads. Per-layer and scanned runs alike; what the target cannot express (a hybrid, a
  ``pre_logits`` layer, 'gap'/'map' pooling for transformers, timm with another LayerNorm
  epsilon) is refused by name (:func:`vit_jax.checkpoint.ecosystem.write`).

Examples::

  python -m vit_jax.convert 81.5_T2T_ViT_14.pth.tar /ckpt/t2t_vit_14 --model T2T-ViT-14
  python -m vit_jax.convert /workdirs/vit_b16_cifar /ckpt/vit_b16_cifar.npz
  python -m vit_jax.convert ViT-B_16.npz /ckpt/vit_b16
  python -m vit_jax.convert /workdirs/vit_cifar /export/vit_cifar_hf --to hf
  python -m vit_jax.convert /workdirs/vit_cifar /export/vit_cifar.safetensors --to timm

It prints what it wrote (format, and per collection the arrays and values in the layout written:
an ``.npz`` holds the unrolled ``encoderblock_{i}`` arrays of a scanned checkpoint). Bad input
(a missing, truncated, damaged or refused ``SRC``, a bad ``--model``, an existing ``DST``) is one
line ``FATAL: <problem and fix>`` on stderr and exit status 2, as ``python -m vit_jax.main``; a
failure while writing is one ``FATAL:`` line and exit status 1. An existing ``DST`` is never
overwritten unless ``--overwrite`` is given.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from vit_jax import checkpoint
from vit_jax.checkpoint import npz
from vit_jax.tools import common

def read(src: str, *, model_name: Optional[str] = None, use_ema: bool = True,
         overrides: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
  """Loads ``src`` as ``{'params': ..., **collections}`` of NumPy arrays (see
  :func:`read_with_facts`)."""
  return read_with_facts(src, model_name=model_name, use_ema=use_ema, overrides=overrides)[0]


def read_with_facts(src: str, *, model_name: Optional[str] = None, use_ema: bool = True,
                    overrides: Optional[Dict[str, Any]] = None
                    ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
  """Loads ``src`` as ``{'params': ..., **collections}`` of NumPy arrays, and the facts an
  Orbax destination keeps (``orbax.EXPORT_JSON``): a run's class names, ``multi_label`` and eval
  preprocessing; a transformers / timm file's class names, image size (and normalization); what
  an earlier convert kept. None for ``.npz`` and PyTorch files.

  Args:
    src: any of ``vit_jax.checkpoint.ACCEPTED_FORMATS``.
    model_name: PyTorch (T2T-ViT) files only: the variant, e.g. 'T2T-ViT-14'.
    use_ema: prefer the checkpoint's parameter EMA.
    overrides: model fields for ``vit_jax.models.create`` (e.g. of 'T2T-ViT-custom').

  Raises:
    FileNotFoundError: nothing at ``src``.
    ValueError: a PyTorch file without ``model_name``, an unknown one; the errors of
      ``checkpoint.load`` (``DamagedCheckpointError``, ``UnsafePickleError`` are ValueErrors).
  """
  ckpt = checkpoint.open(src)
  return _READ[ckpt.name](ckpt, model_name, use_ema, dict(overrides or {}))


def _read_torch(ckpt, model_name, use_ema, overrides):
  if not model_name:
    raise ValueError(f'{ckpt.path} is a PyTorch checkpoint: name its model with --model (e.g. '
                     '--model T2T-ViT-14 or --model T2T-ViT_t-14).')
  from vit_jax import models  # pylint: disable=g-import-not-at-top
  if 'num_classes' in overrides:
    raise ValueError('--set num_classes: the class count (and the input size) are read from '
                     "the file's head.weight and pos_embed; drop it.")
  model = models.create(model_name, num_classes=1000, **overrides)
  return ckpt.read_for_finetuning(model, use_ema), {}


def _read_foreign(ckpt, model_name, use_ema, overrides):
  from vit_jax import inference  # pylint: disable=g-import-not-at-top
  foreign = ckpt.foreign(overrides.get('num_heads'))  # timm: the heads may be needed.
  facts = {'label_names': list(foreign.label_names or []) or None,
           'image_size': foreign.image_size,
           'normalization': inference._hf_normalization(  # pylint: disable=protected-access
               ckpt.probe.hf_directory)}
  return foreign.variables, {k: v for k, v in facts.items() if v is not None}


def _read_weights(ckpt, model_name, use_ema, overrides):
  if model_name or overrides:
    print(f'note: --model/--set apply to PyTorch and timm files only; {ckpt.path} needs '
          'neither (ignored).', file=sys.stderr)
  return ckpt.read(use_ema=use_ema), {}


def _read_orbax(ckpt, model_name, use_ema, overrides):
  return _read_weights(ckpt, model_name, use_ema, overrides)[0], _run_facts(ckpt.path)


#: How each format (``vit_jax.checkpoint.formats``) is read, with the facts it keeps.
_READ = {'pytorch': _read_torch, 'hf': _read_foreign, 'timm': _read_foreign,
         'npz': _read_weights, 'orbax': _read_orbax}


def _run_facts(src: str) -> Dict[str, Any]:
  """The class names and eval preprocessing of an Orbax SOURCE (its latest step): a training
  run's config and dataset record, or what a convert directory kept."""
  from vit_jax.checkpoint import orbax  # pylint: disable=g-import-not-at-top
  from vit_jax.checkpoint import runs  # pylint: disable=g-import-not-at-top
  run = runs.read_run(src)
  if run.config is None:
    return orbax.read_export_metadata(run.state_item) or {}
  data = run.config.get('data') or {}
  facts = {k: data.get(k) for k in ('normalization', 'eval_crop_pct', 'image_size')}
  record = run.dataset or {}
  facts['label_names'] = record.get('label_names') or None
  facts['multi_label'] = record.get('multi_label', run.config.get('loss') == 'sigmoid_xent')
  return {k: v for k, v in facts.items() if v is not None}


def write(variables: Dict[str, Any], dst: str, *, overwrite: bool = False,
          facts: Optional[Dict[str, Any]] = None) -> str:
  """Writes ``variables`` to ``dst`` (a ``.npz`` file or an Orbax directory, which keeps
  ``facts``, see :func:`read_with_facts`); returns the format.

  Raises:
    FileExistsError: ``dst`` exists and ``overwrite`` is False.
    ValueError: ``.npz`` requested for variables with collections other than ``params``.
  """
  if os.path.exists(dst) and not overwrite:
    raise FileExistsError(f'{dst} exists; choose a new destination or pass --overwrite.')
  from vit_jax.models import layout  # pylint: disable=g-import-not-at-top
  variables = layout.unbox(variables)  # Plain arrays (model.init boxes them with axis names).
  if dst.endswith('.npz'):
    extra = sorted(k for k in variables if k != 'params')
    if extra:
      raise ValueError(
          f'The model has fixed tables besides its parameters ({", ".join(extra)}), which the '
          'official .npz layout cannot hold; give a directory as the destination (an Orbax '
          'checkpoint).')
    checkpoint.save_npz(dst, variables['params'])
    return 'official ViT .npz'
  checkpoint.save_orbax(dst, variables, overwrite=overwrite, metadata=facts or None)
  return 'Orbax checkpoint'


def export(src: str, dst: str, to: str, *, model_name: Optional[str] = None,
           use_ema: bool = True, overrides: Optional[Dict[str, Any]] = None) -> str:
  """Writes the ViT at ``src`` as timm (``to='timm'``) or transformers (``to='hf'``) weights.

  The model, its numerics and its class names come from the source
  (:func:`vit_jax.inference.load`: a workdir's saved config, a file's shapes and headers).

  Returns:
    The Python that loads the result in the target library.

  Raises:
    ValueError: what :func:`vit_jax.inference.load` raises, a T2T-ViT, or what the target cannot
      express (:func:`vit_jax.checkpoint.ecosystem.write`).
  """
  from vit_jax import inference  # pylint: disable=g-import-not-at-top
  from vit_jax.checkpoint import ecosystem  # pylint: disable=g-import-not-at-top
  trained = inference.load(src, use_ema=use_ema, model_name=model_name, overrides=overrides)
  fields = dict(trained.config.model.to_dict(), num_classes=trained.config.num_classes)
  if 'hidden_size' not in fields:
    raise ValueError(f'{src} is a {trained.config.model_name}: only ViTs are written for timm '
                     'and transformers.')
  return ecosystem.write(dst, trained.variables['params'], fields, to=to,
                         image_size=int(trained.config.data.image_size),
                         label_names=trained.label_names,
                         normalization=trained.config.data.normalization)


def written_arrays(variables: Dict[str, Any], dst: str) -> Dict[str, Dict[str, Tuple]]:
  """``{collection: {name: (shape, dtype)}}`` of what :func:`write` wrote to ``dst``.

  For a ``.npz``, read from the written file's ``.npy`` headers (its layout: unrolled
  ``encoderblock_{i}`` arrays, float32 for bfloat16); for an Orbax directory, ``variables``
  (written as they are).
  """
  if dst.endswith('.npz'):
    return {'params': npz.read_npz_index(dst)}
  return {name: {key: (np.shape(value), np.asarray(value).dtype)
                 for key, value in checkpoint.flatten_params(tree).items()}
          for name, tree in variables.items()}


def _summary(written: Mapping[str, Mapping[str, Tuple]]) -> str:
  lines = []
  for name, arrays in written.items():
    count = sum(math.prod(shape) for shape, _ in arrays.values())
    dtypes = sorted({str(dtype) for _, dtype in arrays.values()})
    lines.append(f'  {name}: {len(arrays)} arrays, {count:,} values ({", ".join(dtypes)})')
  return '\n'.join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
  """Runs the converter on ``argv`` (default: the command line); returns the exit status."""
  parser = common.Parser(
      prog='python -m vit_jax.convert',
      description=__doc__.split('\n\n')[0] + ' DST is an Orbax checkpoint directory, or an '
      'official-layout .npz file (ViT parameters only).',
      formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog='Examples:\n'
      '  python -m vit_jax.convert 81.5_T2T_ViT_14.pth.tar /ckpt/t2t_vit_14 --model T2T-ViT-14\n'
      '  python -m vit_jax.convert /workdirs/vit_cifar /ckpt/vit_cifar.npz\n'
      'Then fine-tune with --config.init_from=/ckpt/t2t_vit_14.')
  parser.add_argument('src', help=checkpoint.ACCEPTED_FORMATS)
  parser.add_argument('dst', help='a new directory (Orbax checkpoint) or a path ending in .npz; '
                      'with --to timm a .safetensors file, with --to hf a directory (or its '
                      'model.safetensors path)')
  parser.add_argument('--to', choices=('timm', 'hf'),
                      help='write timm (VisionTransformer .safetensors) or Hugging Face '
                      'transformers (config.json + model.safetensors) weights of a ViT')
  parser.add_argument('--model', help='model name, required for PyTorch files '
                      '(T2T-ViT-7/10/12/14/19/24, T2T-ViT_t-14/19/24)')
  parser.add_argument('--set', action='append', default=[], metavar='KEY=VALUE',
                      help='a model field for --model, repeatable (e.g. --set embed_dim=64 for '
                      'T2T-ViT-custom); values are Python literals')
  parser.add_argument('--no_ema', action='store_true',
                      help='take the trained weights rather than their EMA when the source has both')
  parser.add_argument('--overwrite', action='store_true', help='replace an existing DST')
  args = parser.parse_args(argv)
  try:
    src, dst = os.path.realpath(args.src), os.path.realpath(args.dst)
    if src == dst or dst.startswith(src + os.sep) or src.startswith(dst + os.sep):
      raise ValueError(f'{args.dst} is (or contains, or is inside) the source {args.src}: '
                       'write to a new path, the source is never replaced.')
    if args.dst.lower().endswith(('.pth', '.pt', '.tar', '.npy', '.pkl', '.msgpack')):
      raise ValueError(f'{args.dst}: the destination is a directory (Orbax checkpoint) or a '
                       '.npz file, or with --to timm|hf safetensors; other formats are not '
                       'written.')
    overrides = dict(common.parse_setting(s) for s in args.set)
    if args.to:
      return _export(args, overrides)
    if args.dst.endswith('.safetensors'):
      raise ValueError(f'{args.dst}: say which library the .safetensors is for: --to timm or '
                       '--to hf.')
    if os.path.exists(args.dst) and not args.overwrite:  # Before the (long) read.
      raise FileExistsError(f'{args.dst} exists; choose a new destination or pass --overwrite.')
    variables, facts = read_with_facts(args.src, model_name=args.model,
                                       use_ema=not args.no_ema, overrides=overrides)
    kind = write(variables, args.dst, overwrite=args.overwrite, facts=facts)
    written = written_arrays(variables, args.dst)
  except common.INPUT_ERRORS as e:
    return common.fatal(e, 2)
  except OSError as e:  # E.g. the disk filled while writing.
    return common.fatal(e, 1)
  print(f'Wrote {kind} {args.dst} from {args.src}:\n{_summary(written)}')
  if facts and not args.dst.endswith('.npz'):
    print(f'  kept in {checkpoint.orbax.EXPORT_JSON}: {_facts_summary(facts)}')
  elif facts:
    print(f'note: an .npz holds arrays only; not kept: {_facts_summary(facts)} (write a '
          'directory, an Orbax checkpoint, to keep them).', file=sys.stderr)
  return 0


def _facts_summary(facts: Mapping[str, Any]) -> str:
  names = facts.get('label_names')
  parts = [f'{len(names)} class names ({", ".join(map(str, names[:3]))}'
           f'{", ..." if len(names) > 3 else ""})'] if names else []
  parts += [f'{k} {facts[k]}' for k in ('multi_label', 'normalization', 'eval_crop_pct',
                                        'image_size') if k in facts]
  return ', '.join(parts)


def _export(args: argparse.Namespace, overrides: Dict[str, Any]) -> int:
  """``--to timm|hf``: refuses existing outputs (unless --overwrite) before the read, writes,
  prints what was written and how to load it."""
  from vit_jax.checkpoint import ecosystem  # pylint: disable=g-import-not-at-top
  if args.to == 'timm' and not args.dst.endswith('.safetensors'):
    raise ValueError(f'{args.dst}: --to timm writes a .safetensors file; name it so.')
  if args.to == 'hf' and args.dst.endswith('.npz'):
    raise ValueError(f'{args.dst}: --to hf writes a directory (or its model.safetensors).')
  outputs = ecosystem.output_paths(args.dst, args.to)
  existing = [p for p in outputs if os.path.exists(p)]
  if existing and not args.overwrite:
    raise FileExistsError(f'{", ".join(existing)} already exist'
                          f'{"s" if len(existing) == 1 else ""}; choose a new destination or '
                          'pass --overwrite.')
  load = export(args.src, args.dst, args.to, model_name=args.model, use_ema=not args.no_ema,
                overrides=overrides)
  library = 'timm' if args.to == 'timm' else 'transformers'
  sizes = ', '.join(f'{p} ({os.path.getsize(p):,} bytes)' for p in outputs)
  print(f'Wrote {library} weights of {args.src}: {sizes}\nLoad them with:\n  {load}')
  return 0


def run_main() -> None:
  """`python -m vit_jax.convert`: `main()`'s status as the exit code."""
  sys.exit(main())


if __name__ == '__main__':
  run_main()
