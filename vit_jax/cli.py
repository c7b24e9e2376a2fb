"""``--config`` parsed for ``vit_jax.main`` and the tools (:func:`load_config`): a bad config
file, flag or ``--config.<key>`` is one message, not a traceback; a ``ConfigError`` as
command-line text (:func:`error_text`); the keys with their help (:func:`config_help`)."""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import shlex
import shutil
import sys
import textwrap

from absl import flags
from ml_collections import config_flags


def load_config_file(spec: str):
  """`get_config(arg)` of the config file `path[:arg]`, imported as --config does."""
  path, _, arg = spec.partition(":")
  module_spec = importlib.util.spec_from_file_location("_vit_jax_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def unknown_override_message(argv: list[str]) -> str | None:
  """A message naming the first unknown ``--config.<key>`` in ``argv``, the keys there and the
  closest match; None if all exist (or the config file cannot be loaded)."""
  spec = config_spec(argv)
  if spec is None:
    return None
  try:
    config = load_config_file(spec)
  except Exception:  # pylint: disable=broad-except
    return None  # Let the flag parser report the real problem with the file.
  for arg in (a for a in argv if a.startswith("--config.")):
    path = arg[len("--config."):].split("=", 1)[0]
    node = config
    keys = path.split(".")
    for depth, key in enumerate(keys):
      children = list(node.keys()) if hasattr(node, "keys") else []
      if key not in children:
        where = ".".join(keys[:depth]) or "the top level"
        close = difflib.get_close_matches(key, children, n=1)
        hint = f" Did you mean '{'.'.join(keys[:depth] + close)}'?" if close else ""
        return (f"Unknown config key '{path}' in '{arg}': the config {spec} has no '{key}' at "
                f"{where}. Keys there: {', '.join(sorted(children))}.{hint}")
      node = node[key]
  return None


#: absl's message for a boolean flag given another word, an args tuple as it prints it.
_NOT_BOOLEAN = re.compile(r"\('Non-boolean argument to boolean flag', (.+)\)$")
#: Python's messages for an integer or float key given another word (ml_collections parses).
_NOT_INTEGER = re.compile(r"invalid literal for int\(\) with base 10: (.+)$")
_NOT_NUMBER = re.compile(r"could not convert string to float: (.+)$")


def _without_traceback(message: str) -> str:
  """ml_collections' flag error without the config file's traceback: which flag, what is wrong."""
  message = _NOT_BOOLEAN.sub(r"\1 is not a boolean: give True or False", message)
  message = _NOT_INTEGER.sub(r"\1 is not an integer: give a whole number, e.g. 128", message)
  message = _NOT_NUMBER.sub(r"\1 is not a number: give one such as 0.5 or 1e-3", message)
  if "Traceback (most recent call last)" not in message:
    return message
  head = message.split("Traceback (most recent call last)")[0].strip()
  last = [line for line in message.splitlines() if line.strip()][-1]
  return f"{head} {last}"


def config_spec(argv: list[str]) -> str | None:
  """The `path[:arg]` of `--config` in `argv`, or None."""
  spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
  if spec is None and "--config" in argv[:-1]:
    spec = argv[argv.index("--config") + 1]
  return spec


def _parse(flag_values: flags.FlagValues, argv: list[str]) -> list[str]:
  """``flag_values(argv)``: the arguments left. Raises ValueError, one line, for a missing config
  file, a refused flag or config file argument, or an unknown ``--config.<key>``."""
  spec = config_spec(argv)
  path = spec.partition(":")[0] if spec else None
  if path and not os.path.isfile(path):
    here = sorted(p for p in os.listdir("configs") if p.endswith(".py")) if os.path.isdir(
        "configs") else []
    known = f" The configs here: {', '.join('configs/' + p for p in here)}." if here else ""
    raise ValueError(f"The config file {path!r} (--config={spec}) does not exist.{known}")
  try:
    return flag_values(argv)
  # AttributeError, KeyError: ml_collections' for an unknown key; ValueError, TypeError: the
  # config file's get_config(arg) refused its arg.
  except (flags.Error, AttributeError, KeyError, ValueError, TypeError) as e:
    raise ValueError(unknown_override_message(argv) or (
        _without_traceback(str(e)) if isinstance(e, flags.Error) else
        f"Bad --config: {error_text(e)}"))


def load_config(argv: list[str]):
  """The config of ``--config=path[:arg]`` in ``argv`` with its ``--config.key=value``
  overrides, locked, as ``vit_jax.main`` loads it; None without ``--config``. Raises ValueError
  as :func:`_parse`, and for an argument left over."""
  argv = ["", *argv]
  values = flags.FlagValues()
  config = config_flags.DEFINE_config_file("config", None, flag_values=values, sys_argv=argv,
                                           lock_config=True)
  left = _parse(values, argv)[1:]
  if left:
    raise ValueError(f"Unexpected arguments: {' '.join(left)}")
  return config.value


def parse_flags(argv: list[str]) -> list[str]:
  """``vit_jax.main``'s absl flags (:func:`_parse`); returns absl's argv. Exits 2 with one
  ``FATAL:`` line for a bad flag or config, 0 after ``--help``."""
  # absl answers --help and -?; most programs also answer -h (absl would call it unknown).
  end = argv.index("--") if "--" in argv else len(argv)
  argv = ["--help" if a == "-h" and i < end else a for i, a in enumerate(argv)]
  try:
    return _parse(flags.FLAGS, argv)
  except SystemExit as e:
    # absl prints the help asked for (--help, --helpshort, --helpfull, -?) and exits 1; asking
    # for help is not a failure (exit code 1 means one in vit_jax.main's table).
    if e.code == 1 and any(a.split("=")[0] in ("--help", "--helpshort", "--helpfull",
                                                "--helpxml", "-?") for a in argv[1:]):
      sys.exit(0)
    raise
  except ValueError as e:
    sys.stderr.write(f"FATAL: {e}\nPass --help to see the flags.\n")
    sys.exit(2)


#: A setting named in a ConfigError's fix, `config.KEY`, and not already a flag.
_SETTING = re.compile(r"(?<![\w.-])config\.(?=\w)")


def error_text(error: BaseException) -> str:
  """``str(error)`` with the fix of the ``ConfigError`` it is or wraps (its cause or context)
  spelled for the command line: each ``config.KEY`` there as the flag ``--config.KEY``."""
  keys = sys.modules.get("vit_jax.config.keys")  # Not imported: no config was checked.
  text = str(error)
  cause = error
  seen = set()
  while keys is not None and cause is not None and id(cause) not in seen:
    if isinstance(cause, keys.ConfigError):
      library = str(cause)
      flagged = library[:len(library) - len(cause.fix)] + _SETTING.sub("--config.", cause.fix)
      return text.replace(library, flagged)
    seen.add(id(cause))
    cause = cause.__cause__ or cause.__context__
  return text


def _flag_value(value, kind: type) -> str:
  """`value` as typed after ``--config.KEY=`` in a shell; None: ``<TYPE>``."""
  if value is None:
    return f"<{kind.__name__}>"
  if isinstance(value, (list, tuple)):
    value = tuple(value)
  return shlex.quote(value if isinstance(value, str) else str(value))


def _model_help() -> dict:
  """{field: (type, help)} of every model family's fields, in their order."""
  from vit_jax.models import t2t  # pylint: disable=g-import-not-at-top  (JAX: after --help)
  from vit_jax.models import vit_fields  # pylint: disable=g-import-not-at-top
  helps = {}
  for field in vit_fields.VIT_FIELDS + vit_fields.HYBRID_FIELDS + t2t.T2T_FIELDS:
    helps.setdefault(field.name, (field.type, field.help))
  return helps


def _key_lines(flag: str, text: str, width: int, column: int) -> list[str]:
  """``flag`` then ``text`` wrapped in a column from ``column`` on (below a longer flag)."""
  indent = " " * column
  if not text:
    return [flag]
  if len(flag) < column - 1:
    return textwrap.wrap(text, width, initial_indent=flag.ljust(column), subsequent_indent=indent,
                         break_on_hyphens=False)
  return [flag] + textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=indent,
                                break_on_hyphens=False)


#: Where the help of each key starts in :func:`config_help`.
HELP_COLUMN = 40


def config_help(config=None, spec: str | None = None, width: int | None = None) -> str:
  """Every key of ``config`` (None: the defaults) with the regime's values filled in, as the
  flag that sets it (``--config.KEY=VALUE``; unset: ``--config.KEY=<TYPE>``) and its one line of
  help, by section; wrapped to ``width`` (default: the terminal's)."""
  from vit_jax import config as config_lib  # pylint: disable=g-import-not-at-top  (JAX)
  defaults = config_lib.defaults
  if config is None:
    config = defaults.get_config()
  config = config_lib.fill_regime(config)
  width = max(width or shutil.get_terminal_size((100, 24)).columns, HELP_COLUMN + 20)
  source = f"config file {spec}" if spec else "defaults (no --config)"
  lines = textwrap.wrap(
      f"Every key of the {source}, with the --config.KEY=VALUE overrides and the regime "
      f"({config.regime}) applied: the flag that sets it, then what it is (docs/configs.md).",
      width) + [""]
  sections = [("", {k.name: (k.type, k.help) for k in defaults.RUN_KEYS}, None)]
  for name, (declared, text) in defaults.SECTIONS.items():
    helps = _model_help() if name == "model" else {k.name: (k.type, k.help) for k in declared}
    sections.append((name, helps, text))
  for name, helps, text in sections:
    if name and name not in config:  # A config file without the section.
      continue
    node = config[name] if name else config
    if name:
      lines += ["", f"config.{name}: {text}"]
    documented = [k for k in helps if k in node]
    undocumented = sorted(set(node.keys()) - set(helps))
    for key in documented + undocumented:
      if hasattr(node[key], "items"):  # A section: listed under its own header.
        continue
      kind, what = helps.get(key, (object, ""))
      section = f"{name}." if name else ""
      value = _flag_value(node[key], kind)
      flag = f"--config.{section}{key}={value}"
      lines += _key_lines(flag, what, width, HELP_COLUMN)
  return "\n".join(lines)
