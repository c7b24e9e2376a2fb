"""What the command-line tools share: the parser, the one ``FATAL:`` report, ``--set`` fields,
SOURCE arguments, and one convention: a tool's ``main(argv=None)``, decorated with
:func:`exit_status` (which owns the exit statuses), is the command on ``argv``, raising rather
than catching (:func:`input_errors`, :func:`output_errors` convert other errors); its
``run_main()`` (:func:`run_program`) is the program ``python -m vit_jax.<tool>`` runs
(``vit_jax.tools.<tool>`` for the helpers without one).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import os
import signal
import sys
from typing import Any, Tuple

from vit_jax import cli
from vit_jax import platform
from vit_jax import rundir
from vit_jax import storage

#: The errors of bad input (exit status 2).
INPUT_ERRORS = (ValueError, TypeError, KeyError, FileNotFoundError, FileExistsError,
                PermissionError, IsADirectoryError, NotADirectoryError, NotImplementedError,
                storage.NotAFileError)
#: The exit status of a tool stopped by Ctrl-C (or a signal it turned into KeyboardInterrupt).
INTERRUPTED = 130


class WorkFailed(RuntimeError):
  """A failure while working, after the input was accepted (exit status 1)."""


@contextlib.contextmanager
def output_errors(kinds=(OSError,)):
  """Raises an error of ``kinds`` (default OSError) inside as :class:`WorkFailed` from it: an
  output that could not be written is a failure (exit status 1), even a PermissionError."""
  try:
    yield
  except kinds as e:
    raise WorkFailed(reason(e)) from e


@contextlib.contextmanager
def input_errors(kinds):
  """Raises an error of ``kinds`` inside as a ValueError from it: bad input (exit status 2)."""
  try:
    yield
  except kinds as e:
    raise ValueError(reason(e)) from e


def reason(error: Exception) -> str:
  """The error's message in one line (an OSError's with its file name; a config refusal's fix
  as flags, ``vit_jax.cli.error_text``)."""
  if isinstance(error, OSError) and error.strerror:
    text = error.strerror
    if error.filename is not None and os.fsdecode(error.filename) not in text:
      text = f'{text}: {os.fsdecode(error.filename)!r}'
    return text
  if isinstance(error, KeyError) and len(error.args) == 1:
    return str(error.args[0])
  if isinstance(error, KeyboardInterrupt) and not error.args:
    return 'Stopped.'
  text = ' '.join(line.strip() for line in cli.error_text(error).splitlines() if line.strip())
  return text or type(error).__name__


def fatal(error: Exception, code: int) -> int:
  """Prints ``FATAL: <reason>`` to stderr; returns ``code`` (the exit status)."""
  print(f'FATAL: {reason(error)}', file=sys.stderr)
  return code


def parse_setting(text: str) -> Tuple[str, Any]:
  """'embed_dim=64' -> ('embed_dim', 64): a Python literal (or true/false), else the string;
  ValueError unless KEY=VALUE."""
  key, sep, value = (part.strip() for part in text.partition('='))
  if not sep or not key:
    raise ValueError(f'--set {text!r}: expected KEY=VALUE, e.g. --set embed_dim=64 ({text!r} '
                     'is not KEY=VALUE).')
  if value.lower() in ('true', 'false'):
    return key, value.lower() == 'true'
  try:
    return key, ast.literal_eval(value)
  except (ValueError, SyntaxError):
    return key, value


class Parser(argparse.ArgumentParser):
  """argparse: a usage error (a ``gs://`` argument without a valid bucket too) is one ``FATAL:``
  line, exit status 2; the help keeps the description's lines, ````x```` shown as x."""

  def __init__(self, *args, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs):
    super().__init__(*args, formatter_class=formatter_class, **kwargs)

  def parse_known_args(self, args=None, namespace=None):
    parsed, rest = super().parse_known_args(args, namespace)
    for action in self._actions:
      value = getattr(parsed, action.dest, None)
      values = value if isinstance(value, list) else [value]
      if action.option_strings:
        name = action.option_strings[-1]
      elif isinstance(action.metavar, str):
        name = action.metavar
      else:
        name = action.dest.upper()
      try:
        for url in values:
          storage.check_url(url, name)
      except ValueError as e:
        self.error(str(e))
    return parsed, rest

  def format_help(self):
    return super().format_help().replace('``', '')

  def error(self, message):
    self.exit(2, f'FATAL: {message}\n')


def exit_status(main):
  """``main`` (``-> int``, the exit status) answering bad input (:data:`INPUT_ERRORS`) with a
  ``FATAL:`` line and exit status 2; :class:`WorkFailed` and other OSErrors (e.g. a full disk)
  with 1; KeyboardInterrupt with :data:`INTERRUPTED`."""

  @functools.wraps(main)
  def wrapped(*args, **kwargs) -> int:
    try:
      return main(*args, **kwargs)
    except INPUT_ERRORS as e:
      return fatal(e, 2)
    except (WorkFailed, OSError) as e:
      return fatal(e, 1)
    except KeyboardInterrupt as e:
      return fatal(e, INTERRUPTED)
    except Exception as e:  # pylint: disable=broad-except  (TensorFlow's gs:// errors)
      failure = storage.failure(e)
      if not failure:
        raise
      return fatal(RuntimeError(failure[0]), failure[1])

  return wrapped


def add_set_argument(parser: argparse.ArgumentParser, example: str) -> None:
  """``--set KEY=VALUE``, repeatable, into ``args.set`` (each read by :func:`parse_setting`)."""
  parser.add_argument('--set', action='append', default=[], metavar='KEY=VALUE',
                      help=f'a model field, repeatable ({example}); values are Python literals')


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
  """SOURCE and the flags of ``vit_jax.inference.load`` (:func:`load_source`)."""
  parser.add_argument('source', metavar='SOURCE', help=rundir.ACCEPTED_FORMATS)
  parser.add_argument('--step', type=int, help="a workdir's step (default: the latest)")
  parser.add_argument('--model', help='the model of a .pth.tar (required: T2T-ViT-7/10/12/14/'
                      '19/24, T2T-ViT_t-14/19/24) or of an .npz (optional: read from its '
                      'shapes, checked when given); a workdir names its own')
  add_set_argument(parser, 'e.g. --set embed_dim=64 for T2T-ViT-custom; --set num_heads=N for '
                   'a timm file of a non-standard width')
  parser.add_argument('--num-classes', type=int,
                      help='checked against the head of the weights (they decide)')
  parser.add_argument('--image-size', type=int,
                      help='input side S (default: from the position embedding grid); at '
                      'another, a ViT resamples its learned table in the model (--set '
                      'posemb_resize=...: how; a timm file: bicubic, antialiased, as timm)')
  parser.add_argument('--no-ema', action='store_true',
                      help='the trained weights rather than their EMA when the source has both')


def load_source(args: argparse.Namespace):
  """``vit_jax.inference.load`` of the SOURCE arguments; raises what it raises."""
  from vit_jax import inference  # pylint: disable=g-import-not-at-top  (JAX: after --help)
  return inference.load(args.source, step=args.step, use_ema=not args.no_ema,
                        model_name=args.model, num_classes=args.num_classes,
                        image_size=args.image_size,
                        overrides=dict(parse_setting(s) for s in args.set))


def size_text(n) -> str:
  """Bytes as '1.50 GiB' from a quarter GiB, else '12.3 MiB' ('-' for None)."""
  if n is None:
    return '-'
  return f'{n / 2**30:.2f} GiB' if n >= 2**28 else f'{n / 2**20:.1f} MiB'


def check_output_folder(path, flag: str) -> None:
  """Raises ValueError when the folder of the output file ``path`` of ``flag`` is missing."""
  folder = os.path.dirname(os.path.abspath(path or '.'))
  if path and not os.path.isdir(folder):
    raise ValueError(f'{flag} {path}: the directory {folder} does not exist.')


def pid_alive(pid: int) -> bool:
  """Whether process ``pid`` of this host exists (``vit_jax.checkpoint.lock.process_alive``)."""
  from vit_jax.checkpoint import lock  # pylint: disable=g-import-not-at-top  (JAX, for a tool)
  return lock.process_alive(pid)


def missing_source(args: argparse.Namespace):
  """A FileNotFoundError for a local SOURCE with nothing there, else None. A Hub name is
  resolved now (``storage.normalize``): its error (e.g. not cached, offline), else None."""
  source = getattr(args, 'source', None)
  if storage.is_hub_name(source):
    try:
      storage.normalize(source)
    except (ValueError, OSError) as e:
      return e
    return None
  if not isinstance(source, str) or storage.is_remote(source) or os.path.exists(source):
    return None
  return FileNotFoundError(f'SOURCE {source!r} does not exist: give {rundir.ACCEPTED_FORMATS}.')


def unsaved_run(args: argparse.Namespace):
  """The error of a local SOURCE run lacking the step asked for, told by the file system (only
  then is ``checkpoint.saved_run.read_run``, which imports JAX, called for its message), or None."""
  source, step = getattr(args, 'source', None), getattr(args, 'step', None)
  if not isinstance(source, str) or storage.is_remote(source) or not os.path.isdir(source):
    return None
  checkpoints = rundir.find(source).checkpoints
  if checkpoints is None:
    return None  # Not a run (a file's directory, a convert directory, one step).
  saved = rundir.saved_steps(checkpoints, readable=True)
  if saved and (step is None or step in saved):
    return None
  from vit_jax.checkpoint import saved_run  # pylint: disable=g-import-not-at-top
  try:
    saved_run.read_run(source, step=step)
  except (FileNotFoundError, ValueError) as e:
    return e
  return None


def run_config(source: str):
  """The ``config.json`` dict of a local SOURCE that is a training workdir (it has
  ``checkpoints/``), read without the set-up; None for other sources or an unreadable file."""
  checkpoints = os.path.join(source, rundir.CHECKPOINTS_DIR)
  if storage.is_remote(source) or not os.path.isdir(checkpoints):
    return None
  try:
    return rundir.read_json(os.path.join(source, rundir.CONFIG_JSON))
  except (OSError, ValueError):
    return None


def _tool_setup() -> None:
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')  # The tools report bad images themselves.
  platform.setup()


def run_program(main, parser=None, precheck=None, setup=_tool_setup) -> None:
  """Runs a tool's ``main()`` as the program. ``--help``, flags ``parser`` refuses,
  :func:`missing_source`, :func:`unsaved_run` and ``precheck`` (``(args) -> Exception or
  None``) answer first, before JAX or TensorFlow load; then ``setup()`` (default
  ``vit_jax.platform.setup``; a ValueError exits 2) and ``main()``."""
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
  try:
    setup()
  except ValueError as e:
    sys.exit(fatal(e, 2))
  sys.exit(main())
