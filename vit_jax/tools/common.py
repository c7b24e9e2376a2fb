"""What the command-line tools share: the usage-error parser, the one-line ``FATAL:`` report,
``--set KEY=VALUE`` model fields, and the SOURCE arguments of the tools that load a model.

Bad input is one line ``FATAL: <problem and fix>`` on stderr and exit status 2; a failure
while working (e.g. writing an output) is exit status 1.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import signal
import sys
from typing import Any, Tuple

#: The errors of bad input (exit status 2).
INPUT_ERRORS = (ValueError, TypeError, KeyError, FileNotFoundError, FileExistsError,
                PermissionError, IsADirectoryError, NotADirectoryError, NotImplementedError)


def reason(error: Exception) -> str:
  """One line: the error's message (an OSError's with its file name; the lines of a multi-line
  message joined)."""
  if isinstance(error, OSError) and error.strerror:
    text = error.strerror
    if error.filename is not None and os.fsdecode(error.filename) not in text:
      text = f'{text}: {os.fsdecode(error.filename)!r}'
    return text
  if isinstance(error, KeyError) and len(error.args) == 1:
    return str(error.args[0])
  text = ' '.join(line.strip() for line in str(error).splitlines() if line.strip())
  return text or type(error).__name__


def fatal(error: Exception, code: int) -> int:
  """Prints ``FATAL: <reason>`` to stderr; returns ``code`` (the exit status)."""
  print(f'FATAL: {reason(error)}', file=sys.stderr)
  return code


def parse_setting(text: str) -> Tuple[str, Any]:
  """'embed_dim=64' -> ('embed_dim', 64); a non-literal value stays a string. ValueError if not K=V.
  """
  key, sep, value = text.partition('=')
  if not sep or not key:
    raise ValueError(f'--set {text!r}: expected KEY=VALUE, e.g. --set embed_dim=64.')
  try:
    return key, ast.literal_eval(value)
  except (ValueError, SyntaxError):
    return key, value


class Parser(argparse.ArgumentParser):
  """argparse, with a usage error as the usage and one ``FATAL:`` line (exit status 2), and
  the help's reST literals (````x````) shown as plain text."""

  def format_help(self):
    return super().format_help().replace('``', '')

  def error(self, message):
    self.print_usage(sys.stderr)
    self.exit(2, f'FATAL: {message}\n')


#: What SOURCE may be (the help of :func:`add_source_arguments`).
SOURCE_HELP = ('a training workdir (its latest step; or its checkpoints/ or one step directory), '
               'an official or big_vision ViT .npz, a transformers ViT directory (config.json + '
               'model.safetensors), a timm .safetensors, a T2T-ViT .pth/.pth.tar, or a directory '
               'written by python -m vit_jax.convert')


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
  """SOURCE and the flags of ``vit_jax.inference.load``: --step, --model, --set,
  --num-classes, --image-size, --no-ema."""
  parser.add_argument('source', metavar='SOURCE', help=SOURCE_HELP)
  parser.add_argument('--step', type=int, help="a workdir's step (default: the latest)")
  parser.add_argument('--model', help='the model of a .pth.tar (required: T2T-ViT-7/10/12/14/'
                      '19/24, T2T-ViT_t-14/19/24) or of an .npz (optional: read from its '
                      'shapes, checked when given); a workdir names its own')
  parser.add_argument('--set', action='append', default=[], metavar='KEY=VALUE',
                      help='a model field for --model, repeatable (e.g. --set embed_dim=64 for '
                      'T2T-ViT-custom; --set num_heads=N for a timm file of a non-standard '
                      'width); values are Python literals')
  parser.add_argument('--num-classes', type=int,
                      help='checked against the head of the weights (they decide)')
  parser.add_argument('--image-size', type=int,
                      help='input side S (default: from the position embedding grid)')
  parser.add_argument('--no-ema', action='store_true',
                      help='the trained weights rather than their EMA when the source has both')


def load_source(args: argparse.Namespace):
  """``vit_jax.inference.load`` of the parsed SOURCE arguments (see
  :func:`add_source_arguments`). Raises what ``load`` raises."""
  from vit_jax import inference  # pylint: disable=g-import-not-at-top
  return inference.load(args.source, step=args.step, use_ema=not args.no_ema,
                        model_name=args.model, num_classes=args.num_classes,
                        image_size=args.image_size,
                        overrides=dict(parse_setting(s) for s in args.set))


def missing_source(args: argparse.Namespace):
  """A FileNotFoundError naming a local SOURCE with nothing there, else None (remote not checked).
  """
  source = getattr(args, 'source', None)
  if not isinstance(source, str) or '://' in source or os.path.exists(source):
    return None
  return FileNotFoundError(f'SOURCE {source!r} does not exist: give {SOURCE_HELP}.')


def unsaved_run(args: argparse.Namespace):
  """The error of a local SOURCE run lacking the step asked for, told by the file system, or None.

  Only then is ``vit_jax.checkpoint.runs.read_run`` called, for its message (it imports JAX).
  """
  source, step = getattr(args, 'source', None), getattr(args, 'step', None)
  if not isinstance(source, str) or '://' in source or not os.path.isdir(source):
    return None
  checkpoints = os.path.join(source, 'checkpoints')
  if not os.path.isdir(checkpoints):
    is_checkpoints = os.path.basename(os.path.normpath(source)) == 'checkpoints'
    if not is_checkpoints and not any(n.isdigit() for n in os.listdir(source)):
      return None  # Not a run (a file's directory, a convert directory, one step).
    checkpoints = source
  saved = {int(n) for n in os.listdir(checkpoints)
           if n.isdigit() and os.path.isfile(os.path.join(checkpoints, n, 'state', '_METADATA'))}
  if saved and (step is None or step in saved):
    return None
  from vit_jax.checkpoint import runs  # pylint: disable=g-import-not-at-top
  try:
    runs.read_run(source, step=step)
  except (FileNotFoundError, ValueError) as e:
    return e
  return None


def run_config(source: str):
  """The ``config.json`` dict of a local SOURCE that is a training workdir (it has
  ``checkpoints/``), read without the set-up; None for other sources or an unreadable file."""
  if '://' in source or not os.path.isdir(os.path.join(source, 'checkpoints')):
    return None
  try:
    with open(os.path.join(source, 'config.json'), 'rb') as f:
      config = json.load(f)
  except (OSError, ValueError):
    return None
  return config if isinstance(config, dict) else None


def run_program(main, parser=None, precheck=None) -> None:
  """Runs a tool's ``main()`` (``() -> int``, the exit status) as the program.

  ``--help``, flags ``parser`` refuses, :func:`missing_source`, :func:`unsaved_run` and
  ``precheck`` (``(args) -> Exception or None``) answer first, without importing JAX or
  TensorFlow; then ``vit_jax.platform.setup`` (TensorFlow's C++ warnings off: the tools report
  bad images themselves) and ``main()``. A closed pipe ends the program quietly.
  """
  if hasattr(signal, 'SIGPIPE'):  # `... | head`: end quietly, as shell tools do.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
  if any(arg in ('-h', '--help') for arg in sys.argv[1:]):
    sys.exit(main())  # The help, without the set-up's imports (JAX, TensorFlow).
  if parser is not None:  # Exits on flags that do not parse; main() parses them again.
    args = parser().parse_args()
    for check in (missing_source, unsaved_run, precheck or (lambda _: None)):
      error = check(args)
      if error is not None:
        sys.exit(fatal(error, 2))
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  from vit_jax import platform  # pylint: disable=g-import-not-at-top
  try:
    platform.setup()
  except ValueError as e:
    sys.exit(fatal(e, 2))
  sys.exit(main())
