"""Tree policies from outside the package: ``--policy-module`` for the command lines.

A researcher's policy (``policies.register_policy``, e.g. one written in
``notebooks/tree_policies.ipynb``) lives in a file or module of its own; the server and the
generation CLI import it before they check ``--spec`` / ``--policy``, so it is served like a
built-in one::

    python -m ddtree_jax.serve --policy-module my_policies.py --spec ddtree_floor
    python -m ddtree_jax.generate --policy-module my_pkg.policies --policy ddtree_floor

A dotted name is imported from ``sys.path`` (``python -m`` puts the working directory there, the
``ddtree-serve`` console script does not: a path to the file works under both). Every error names
the module: a missing file, a module that fails to import (with its error; what it registered
before failing is removed again) and one that registers no policy.
"""

import argparse
import hashlib
import importlib
import importlib.util
import json
import sys
from pathlib import Path

from ddtree_jax import policies

FLAG = "--policy-module"
# Module name -> the policies it registered, so that loading a module again (a test or notebook
# calling a CLI twice, two flags naming one module) returns them instead of importing it again.
_LOADED: dict = {}


def _module_name(source: str) -> tuple:
  """(module name, file path or None): a file gets a name of its own per resolved path, so two
  files of one stem do not replace each other in ``sys.modules``."""
  if not (source.endswith(".py") or "/" in source or "\\" in source):
    return source, None
  path = Path(source)
  digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:8]
  return f"_ddtree_policy_module_{path.stem}_{digest}", path


def _registered_by(module_name: str) -> set:
  """Registered policies whose function was defined in ``module_name``."""
  return {name for name, fn in policies._POLICIES.items()  # pylint: disable=protected-access
          if getattr(fn, "__module__", None) == module_name}


def load_policy_module(source: str) -> tuple:
  """Imports ``source``, a path to a ``.py`` file or a dotted module name, for the tree policies it
  registers (``policies.register_policy``); returns their names. Loading a module again returns
  the names of its first load. A ValueError names the source on any failure."""
  module_name, path = _module_name(source)
  if module_name in _LOADED:
    return _LOADED[module_name]
  if path is not None and not path.is_file():
    raise ValueError(f"policy module {source!r}: no such file")
  before = set(policies.available_policies())
  registry = dict(policies._POLICIES)  # pylint: disable=protected-access
  try:
    if path is None:
      importlib.import_module(module_name)
    elif module_name not in sys.modules:
      spec = importlib.util.spec_from_file_location(module_name, path)
      module = importlib.util.module_from_spec(spec)
      sys.modules[module_name] = module
      try:
        spec.loader.exec_module(module)
      except BaseException:
        del sys.modules[module_name]
        raise
  except (Exception, SystemExit) as err:  # a module that calls sys.exit() on import must not end the server
    # A half-imported module's policies go, and any it replaced (replace=True) come back.
    policies._POLICIES.clear()  # pylint: disable=protected-access
    policies._POLICIES.update(registry)  # pylint: disable=protected-access
    raise ValueError(f"policy module {source!r} failed to import: {type(err).__name__}: {err}") from err
  # New names, and those of a module some earlier import had already run (its policies are
  # registered, so the registry did not change now).
  added = tuple(sorted((set(policies.available_policies()) - before) | _registered_by(module_name)))
  if not added:
    raise ValueError(f"policy module {source!r} registered no policy (decorate a policy function with "
                     "@policies.register_policy(name))")
  _LOADED[module_name] = added
  return added


def add_argument(parser: argparse.ArgumentParser) -> None:
  """Adds ``--policy-module`` and ``--policy-option`` (``parse_options`` reads the latter)."""
  parser.add_argument(FLAG, action="append", default=[], metavar="PATH_OR_MODULE",
                      help="a .py file (or a module on sys.path) that registers tree policies "
                           "(policies.register_policy) to offer beside the built-in ones; may be given more than once")
  parser.add_argument("--policy-option", action="append", default=[], metavar="NAME=VALUE",
                      help="an option of the tree policy, e.g. width=4 for beam; VALUE is read as JSON "
                           "(numbers, true/false, lists) or else taken as a string; may be given more than once")


def _no_constant(name):
  raise ValueError(f"{name} is not a number an option can take")


def parse_options(pairs) -> dict:
  """``["width=4", "name=x"]`` -> ``{"width": 4, "name": "x"}``: each value as JSON, else the string."""
  options = {}
  for pair in pairs:
    name, sep, text = pair.partition("=")
    if not sep or not name.isidentifier():
      raise ValueError(f"--policy-option {pair!r}: expected NAME=VALUE")
    if name in options:
      raise ValueError(f"--policy-option {name} given twice")
    try:
      options[name] = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError:
      options[name] = text
    except ValueError as err:
      raise ValueError(f"--policy-option {pair!r}: {err}") from None
  return options


def load_from_argv(argv, prog: str) -> None:
  """Loads every ``--policy-module`` of ``argv`` (None: ``sys.argv[1:]``) before the caller builds
  its parser, whose policy choices then include theirs; exits with a usage error naming a module
  that fails. The caller's parser must not take abbreviated flags (``allow_abbrev=False``): this
  pass reads only the whole flag, so an abbreviation would reach the parser unloaded."""
  pre = argparse.ArgumentParser(prog=prog, add_help=False, allow_abbrev=False)  # "--policy" is not ours
  add_argument(pre)
  known, rest = pre.parse_known_args(argv)
  for arg in rest:  # an abbreviation would otherwise surface as "invalid choice" for the policy it names
    flag = arg.split("=", 1)[0]
    if flag.startswith("--policy-m") and FLAG.startswith(flag):  # "--policy" and "--policy-option" are others
      pre.error(f"unrecognized argument {flag}: the flag is {FLAG} (whole flags only)")
  for source in known.policy_module:
    try:
      load_policy_module(source)
    except ValueError as err:
      pre.error(str(err))
