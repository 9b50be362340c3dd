"""``benchmarks/bench_serve.py``: the server it measures runs as ``python -m ddtree_jax.serve`` in its
own process, and a server that cannot start is reported with its own output, not waited on. (The
benchmark itself runs on the GPU; its full run on the CPU takes minutes of compilation.)"""

import argparse

import pytest

from tests.benchmarks import load_benchmark


def test_a_server_that_cannot_start_is_reported_with_its_output():
  bench = load_benchmark("bench_serve")
  args = argparse.Namespace(budget="1:oops", max_prompt=32, max_tokens=8, dtype="float32", attention_impl="xla",
                            moe_impl="xla")
  with pytest.raises(RuntimeError, match=r"(?s)the ddtree server exited.*error: --budget '1:oops'"):
    with bench.server_process(args, "ddtree", 2):
      pass
