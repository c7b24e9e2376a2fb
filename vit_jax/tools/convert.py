"""Converts model checkpoints between formats: ``python -m vit_jax.convert SRC DST``.

Reads any of ``vit_jax.checkpoint.ACCEPTED_FORMATS`` and writes a directory: an Orbax
checkpoint ``{'params', 'model_state'}`` (``--config.init_from=DST`` fine-tunes from it) with
the source's class names, eval preprocessing and model fields in ``vit_jax_export.json``; a
file ending in .npz: the official ViT layout with those facts in ``X.vit_jax.json`` beside it;
``--to timm``: a timm ``.safetensors``; ``--to hf``: a transformers ViT directory. What the
target cannot express is refused by name. Details: docs/checkpoints.md.

Examples:

  python -m vit_jax.convert 81.5_T2T_ViT_14.pth.tar /ckpt/t2t_vit_14 --model T2T-ViT-14
  python -m vit_jax.convert /workdirs/vit_b16_cifar /ckpt/vit_b16_cifar.npz
  python -m vit_jax.convert /workdirs/vit_cifar /export/vit_cifar_hf --to hf

Bad input (a missing, damaged or refused SRC, a bad ``--model``, an existing DST without
``--overwrite``, a DST in the workdir of a running training run) is one ``FATAL:`` line and exit
status 2; a failure while writing, exit 1. Every output is written beside and moved into place:
stopped at any moment, DST holds the old output (or none) or the new one; only an Orbax
directory replaced in a bucket is deleted first.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from vit_jax import checkpoint
from vit_jax import inference
from vit_jax import models
from vit_jax import storage
from vit_jax.checkpoint import ecosystem
from vit_jax.checkpoint import lock as lock_lib
from vit_jax.checkpoint import npz
from vit_jax.checkpoint import vit_shapes
from vit_jax.models import layout
from vit_jax.tools import common


def read_with_facts(src: str, *, model_name: Optional[str] = None, use_ema: bool = True,
                    overrides: Optional[Dict[str, Any]] = None, step: Optional[int] = None
                    ) -> Tuple[Dict[str, Any], Dict[str, Any]]:
  """``src`` (a run's ``step``, default its latest) as ``{'params': ..., **collections}`` of
  NumPy arrays, and the ``orbax.EXPORT_FACTS`` it records, with a ViT's ``model`` fields
  (:func:`source_fields`). Raises FileNotFoundError, or ValueError as ``Checkpoint.contents``."""
  ckpt = checkpoint.open(src)
  if (model_name or overrides) and not ckpt.reads_with_model:
    print(f'note: --model/--set apply to PyTorch and timm files only; {ckpt.path} needs '
          'neither (ignored).', file=sys.stderr)
    model_name, overrides = None, {}
  contents = ckpt.contents(use_ema=use_ema, step=step, model_name=model_name,
                           overrides=overrides)
  facts = {k: getattr(contents, k) for k in checkpoint.orbax.EXPORT_FACTS
           if k not in contents.from_paper}
  facts['label_names'] = list(contents.label_names or []) or None
  facts['model'] = source_fields(ckpt, contents, (overrides or {}).get('num_heads'))
  return contents.variables, {k: v for k, v in facts.items() if v is not None}


def source_fields(ckpt: Any, contents: Any, num_heads: Optional[int] = None
                  ) -> Optional[Dict[str, Any]]:
  """Every ``vit_shapes.KEPT_FIELDS`` value the ViT in ``contents`` (of ``ckpt``) computes with,
  JSON-able (absent ones as their defaults): a run's config, else the fields the weights and
  their files record (``Checkpoint.fields``: timm's and transformers' numerics, what a
  converted file kept). None for another model (T2T-ViT)."""
  if contents.run is not None:
    model = dict(contents.run.config.get('model') or {})
    if 'hidden_size' not in model:
      return None
  elif contents.fields is None:
    return None
  else:
    found = ckpt.numerics(num_heads)
    model = {**contents.fields, **(found[0] if found else {}), **contents.numerics}
  model = {**models.fields.defaults(models.vit_fields.VIT_FIELDS), **model}
  if model.get('resnet_num_layers') is None:  # Not a hybrid: no stem fields.
    model = {k: v for k, v in model.items() if not k.startswith('resnet_')}
  return vit_shapes.kept_fields(model)


def write(variables: Dict[str, Any], dst: str, *, overwrite: bool = False,
          facts: Optional[Dict[str, Any]] = None) -> str:
  """Writes ``variables`` to ``dst`` (an ``.npz`` file, or an Orbax directory that keeps
  ``facts``); returns the format. Raises FileExistsError, or ValueError (an ``.npz`` of other
  collections than ``params``, :func:`refuse_running_workdir`)."""
  refuse_running_workdir(dst)
  if storage.exists(dst) and not overwrite:
    raise FileExistsError(f'{dst} exists; choose a new destination or pass --overwrite.')
  variables = layout.unbox(variables)  # Plain arrays (model.init boxes them with axis names).
  if dst.endswith('.npz'):
    extra = sorted(k for k in variables if k != 'params')
    if extra:
      raise ValueError(
          f'The model has fixed tables besides its parameters ({", ".join(extra)}), which the '
          'official .npz layout cannot hold; give a directory as the destination (an Orbax '
          'checkpoint).')
    checkpoint.save_npz(dst, variables['params'])
    if facts:
      npz.save_npz_facts(dst, facts)
    return 'official ViT .npz'
  checkpoint.save_orbax(dst, variables, overwrite=overwrite, metadata=facts or None)
  return 'Orbax checkpoint'


def export(src: str, dst: str, to: str, *, model_name: Optional[str] = None,
           use_ema: bool = True, overrides: Optional[Dict[str, Any]] = None,
           step: Optional[int] = None, image_size: Optional[int] = None) -> str:
  """Writes the ViT at ``src`` (:func:`vit_jax.inference.load`) as timm (``to='timm'``) or
  transformers (``to='hf'``) weights (without a head: a feature extractor); returns the Python
  that loads them. Raises ValueError (what ``load`` raises, a T2T-ViT, what the target cannot
  express, :func:`refuse_running_workdir`)."""
  headless = False  # A ViT without a head is written as a feature extractor.
  with contextlib.suppress(ValueError):  # (Reported by the load: a T2T-ViT, unknown heads.)
    fields = checkpoint.open(src).fields((overrides or {}).get('num_heads'))
    headless = fields.get('num_classes') is None
  trained = inference.load(src, use_ema=use_ema, model_name=model_name, overrides=overrides,
                           step=step, num_classes=0 if headless else None,
                           image_size=image_size)
  fields = dict(trained.config.model.to_dict(), num_classes=trained.config.num_classes)
  if 'hidden_size' not in fields:
    raise ValueError(f'{src} is a {trained.config.model_name}: only ViTs are written for timm '
                     'and transformers.')
  refuse_running_workdir(dst)
  data = trained.config.data
  load = ecosystem.write(dst, trained.variables['params'], fields, to=to,
                         image_size=int(data.image_size), label_names=trained.label_names,
                         normalization=data.normalization, eval_crop_pct=data.eval_crop_pct)
  note = ecosystem.resize_note(fields, to)
  if note:
    print(f'note: {note}', file=sys.stderr)
  return load


def written_arrays(variables: Dict[str, Any], dst: str) -> Dict[str, Dict[str, Tuple]]:
  """``{collection: {name: (shape, dtype)}}`` of what :func:`write` wrote to ``dst`` (an
  ``.npz``'s from its headers: its layout unrolls a scanned model)."""
  if dst.endswith('.npz'):
    return {'params': npz.read_npz_index(dst)}
  return {name: {key: (np.shape(value), np.asarray(value).dtype)
                 for key, value in checkpoint.flatten_params(tree).items()}
          for name, tree in variables.items()}


def refuse_running_workdir(dst: str) -> None:
  """Raises ValueError when ``dst`` is, or is inside, the workdir of a live training run
  (``WorkdirLock.live_holder``: a killed run's lock holds nothing)."""
  directories = storage.parents(dst)
  for directory in directories:
    holder = checkpoint.WorkdirLock(directory).live_holder()
    if holder is not None:
      where = ('is the workdir' if directory == directories[0] else
               f'is inside the workdir {directory}')
      raise ValueError(
          f'{dst} {where} of a running training run ({lock_lib.describe(holder)}), which only that '
          'run writes (a replaced workdir loses its checkpoints while the run goes on): wait for '
          'the run to end or stop it, or choose a destination outside its workdir.')


@common.exit_status
def main(argv: Optional[Sequence[str]] = None) -> int:
  parser = common.Parser(prog='python -m vit_jax.convert', description=__doc__)
  parser.add_argument('src', help=checkpoint.ACCEPTED_FORMATS)
  parser.add_argument('dst', help='a new directory (Orbax checkpoint) or a path ending in .npz; '
                      'with --to timm a .safetensors file, with --to hf a directory (or its '
                      'model.safetensors path)')
  parser.add_argument('--to', choices=('timm', 'hf'),
                      help='write timm (VisionTransformer .safetensors) or Hugging Face '
                      'transformers (config.json + model.safetensors) weights of a ViT')
  parser.add_argument('--model', help='model name, required for PyTorch files '
                      '(T2T-ViT-7/10/12/14/19/24, T2T-ViT_t-14/19/24)')
  common.add_set_argument(parser, 'for --model, e.g. --set embed_dim=64 for T2T-ViT-custom')
  parser.add_argument('--step', type=int, help="a training workdir's step (default: its "
                      'latest finalized one)')
  parser.add_argument('--no-ema', '--no_ema', dest='no_ema', action='store_true',
                      help='the trained weights rather than their EMA when the source has both')
  parser.add_argument('--overwrite', action='store_true', help='replace an existing DST')
  parser.add_argument('--image-size', '--image_size', dest='image_size', type=int,
                      help="with --to: the square image size of the written model (needed for "
                      "a source that records none, e.g. posemb='sincos2d')")
  args = parser.parse_args(argv)
  if storage.overlap(args.dst, args.src):
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
  if storage.exists(args.dst) and not args.overwrite:  # Before the (long) read.
    raise FileExistsError(f'{args.dst} exists; choose a new destination or pass --overwrite.')
  refuse_running_workdir(args.dst)  # Before the read too; write() checks again.
  variables, facts = read_with_facts(args.src, model_name=args.model, step=args.step,
                                     use_ema=not args.no_ema, overrides=overrides)
  kind = write(variables, args.dst, overwrite=args.overwrite, facts=facts)
  written = written_arrays(variables, args.dst)
  print(f'Wrote {kind} {args.dst} from {args.src}:')
  for name, arrays in written.items():
    count = sum(math.prod(shape) for shape, _ in arrays.values())
    dtypes = sorted({str(dtype) for _, dtype in arrays.values()})
    print(f'  {name}: {len(arrays)} arrays, {count:,} values ({", ".join(dtypes)})')
  if facts:
    beside = (npz.fields_path(args.dst) if args.dst.endswith('.npz')
              else checkpoint.orbax.EXPORT_JSON)
    print(f'  kept in {beside}: {_facts_summary(facts)}')
  return 0


def _facts_summary(facts: Mapping[str, Any]) -> str:
  names = facts.get('label_names')
  parts = [f'{len(names)} class names ({", ".join(map(str, names[:3]))}'
           f'{", ..." if len(names) > 3 else ""})'] if names else []
  parts += [f'{k} {facts[k]}' for k in checkpoint.orbax.EXPORT_FACTS[1:]  # After the names.
            if k in facts]
  model = facts.get('model') or {}
  if model:  # The numerics the shapes never record, then the other fields not at defaults.
    numerics = ('gelu_approximate', 'layer_norm_epsilon', 'posemb_resize')
    defaults = models.fields.defaults(models.vit_fields.VIT_FIELDS)
    shown = [k for k in model if k in numerics or (
        k in defaults and k not in ('classifier', 'posemb') and model[k] != defaults[k])]
    parts.append(f'{len(model)} model fields (' + ', '.join(
        f'{k}={model[k]!r}' for k in shown) + ')')
  return ', '.join(parts)


def _export(args: argparse.Namespace, overrides: Dict[str, Any]) -> int:
  """``--to timm|hf``: checks the outputs, writes, prints how to load them."""
  if args.to == 'timm' and not args.dst.endswith('.safetensors'):
    raise ValueError(f'{args.dst}: --to timm writes a .safetensors file; name it so.')
  if args.to == 'hf' and args.dst.endswith('.npz'):
    raise ValueError(f'{args.dst}: --to hf writes a directory (or its model.safetensors).')
  outputs = ecosystem.output_paths(args.dst, args.to)
  existing = [p for p in outputs if storage.exists(p)]
  if existing and not args.overwrite:
    raise FileExistsError(f'{", ".join(existing)} already exist'
                          f'{"s" if len(existing) == 1 else ""}; choose a new destination or '
                          'pass --overwrite.')
  refuse_running_workdir(args.dst)  # Before the read too; export() checks again.
  load = export(args.src, args.dst, args.to, model_name=args.model, use_ema=not args.no_ema,
                overrides=overrides, step=args.step, image_size=args.image_size)
  library = 'timm' if args.to == 'timm' else 'transformers'
  sizes = ', '.join(f'{p} ({storage.size(p):,} bytes)' for p in outputs)
  print(f'Wrote {library} weights of {args.src}: {sizes}\nLoad them with:\n  {load}')
  return 0


def run_main() -> None:
  common.run_program(main)
