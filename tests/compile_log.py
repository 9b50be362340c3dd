"""Where the CPU suite's time goes: every XLA compilation, by test (a pytest plugin and its report).

    DDTREE_COMPILE_LOG=/tmp/complog ./dev test -q -p tests.compile_log
    python -m tests.compile_log /tmp/complog

The plugin turns on ``jax_log_compiles``, under which jax logs each compilation ("Finished XLA
compilation of jit(f) in t sec") and each persistent-cache hit, and writes those lines, tagged with the running test,
to one file per pytest process (xdist workers included) and the report sums them per function and
per test file. Logging every compilation slows the run by about a tenth.
"""

import collections
import logging
import os
import re
import sys
from pathlib import Path

import jax

_CURRENT_TEST = ["<collection>"]
_COMPILED = re.compile(r"Finished XLA compilation of (\S+) in ([0-9.e+-]+) sec")


class _TagWithTest(logging.Filter):
  def filter(self, record):
    record.test = _CURRENT_TEST[0]
    return True


def pytest_configure(config):
  out = os.environ.get("DDTREE_COMPILE_LOG")
  if not out:
    raise RuntimeError("tests.compile_log: set DDTREE_COMPILE_LOG to a directory for the logs")
  Path(out).mkdir(parents=True, exist_ok=True)
  handler = logging.FileHandler(Path(out) / f"{os.getpid()}.log")
  handler.addFilter(_TagWithTest())
  handler.setFormatter(logging.Formatter("%(test)s\t%(message)s"))
  handler.setLevel(logging.WARNING)
  logging.getLogger("jax").addHandler(handler)
  jax.config.update("jax_log_compiles", True)


def pytest_runtest_protocol(item, nextitem):
  _CURRENT_TEST[0] = item.nodeid


def report(directory: str, top: int = 25) -> str:
  seconds, count, per_file, hits = (collections.Counter() for _ in range(4))
  small = 0.0
  for path in Path(directory).glob("*.log"):
    for line in path.read_text().splitlines():
      test, _, message = line.partition("\t")
      found = _COMPILED.search(message)
      if found:
        t = float(found.group(2))
        seconds[found.group(1)] += t
        count[found.group(1)] += 1
        per_file[test.split("::")[0]] += t
        small += t if t < 0.2 else 0.0
      elif "cache hit" in message:
        hits[test.split("::")[0]] += 1
  lines = [f"{sum(count.values())} compilations, {sum(seconds.values()):.0f} s "
           f"({small:.0f} s in those under 0.2 s); {sum(hits.values())} persistent-cache hits",
           "", "seconds  count  function"]
  lines += [f"{s:7.1f} {count[name]:6d}  {name}" for name, s in seconds.most_common(top)]
  lines += ["", "seconds  cache hits  test file"]
  files = sorted(set(per_file) | set(hits), key=lambda name: (-per_file[name], name))
  lines += [f"{per_file[name]:7.1f} {hits[name]:11d}  {name}" for name in files]
  return "\n".join(lines)


if __name__ == "__main__":
  print(report(sys.argv[1]))
