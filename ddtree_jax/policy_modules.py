"""Tree policies from outside the package: ``--policy-module`` for the command lines.

A researcher's policy (``policies.register_policy``, e.g. one written in
``notebooks/tree_policies.ipynb``) lives in a file or module of its own; the server and the
generation CLI import it before they check ``--spec`` / ``--policy``, so it is served like a
built-in one::

    python -m ddtree_jax.serve --policy-module my_policies.py --spec ddtree_floor
    python -m ddtree_jax.generate --policy-module my_pkg.policies --policy ddtree_floor

Every error names the module: a missing file, a module that fails to import (with its error) and
one that registers no policy.
"""

import argparse
import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path

from ddtree_jax import policies

FLAG = "--policy-module"
# source (a resolved file path or a module name) -> the policies its import registered, so that a
# second load in one process (a test calling a CLI twice) returns them instead of importing again.
_LOADED: dict = {}


def load_policy_module(source: str) -> tuple:
  """Imports ``source``, a path to a ``.py`` file or a dotted module name, for the tree policies it
  registers (``policies.register_policy``); returns their names. Loading a source again returns
  the names of its first load. A ValueError names the source on any failure."""
  is_file = source.endswith(".py") or "/" in source or "\\" in source
  key = str(Path(source).resolve()) if is_file else source
  if key in _LOADED:
    return _LOADED[key]
  before = set(policies.available_policies())
  if is_file:
    path = Path(source)
    if not path.is_file():
      raise ValueError(f"policy module {source!r}: no such file")
    # A name of its own per file, so two files of one stem do not replace each other in sys.modules.
    name = f"_ddtree_policy_module_{path.stem}_{hashlib.sha1(key.encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
      spec.loader.exec_module(module)
    except Exception as err:
      del sys.modules[name]
      raise ValueError(f"policy module {source!r} failed to import: {type(err).__name__}: {err}") from err
  else:
    try:
      importlib.import_module(source)
    except Exception as err:
      raise ValueError(f"policy module {source!r} failed to import: {type(err).__name__}: {err}") from err
  added = tuple(sorted(set(policies.available_policies()) - before))
  if not added:
    raise ValueError(f"policy module {source!r} registered no policy (decorate a policy function with "
                     "@policies.register_policy(name))")
  _LOADED[key] = added
  return added


def add_argument(parser: argparse.ArgumentParser) -> None:
  parser.add_argument(FLAG, action="append", default=[], metavar="PATH_OR_MODULE",
                      help="a .py file or module that registers tree policies (policies.register_policy) to "
                           "offer beside the built-in ones; may be given more than once")


def load_from_argv(argv, prog: str) -> None:
  """Loads every ``--policy-module`` of ``argv`` (None: ``sys.argv[1:]``) before the caller builds
  its parser, whose policy choices then include theirs; exits with a usage error naming a module
  that fails."""
  pre = argparse.ArgumentParser(prog=prog, add_help=False, allow_abbrev=False)  # "--policy" is not ours
  add_argument(pre)
  known, _ = pre.parse_known_args(argv)
  for source in known.policy_module:
    try:
      load_policy_module(source)
    except ValueError as err:
      pre.error(str(err))
