"""``benchmarks/bench_serve.py``: the server it measures runs as ``python -m ddtree_jax.serve`` in its
own process (``serve.launch.server_process``), started with the benchmark's flags, and a server that
cannot start is reported with its own output, not waited on. (The benchmark itself runs on the GPU;
a full run on the CPU takes minutes of compilation. ``tests/serve/test_server.py`` starts a CLI
server the same way and checks what it reports while loading.)"""

import argparse

import pytest

from serve.launch import server_process
from tests.benchmarks import load_benchmark


def test_a_server_that_cannot_start_is_reported_with_its_output():
  bench = load_benchmark("bench_serve")
  args = argparse.Namespace(budget="1:oops", max_prompt=32, max_tokens=8, dtype="float32", attention_impl="xla",
                            moe_impl="xla")
  seen = []
  with pytest.raises(RuntimeError, match=r"(?s)the server exited with 2: .*--spec ddtree.*error: --budget '1:oops'"):
    with server_process(bench.server_cli_args(args, "ddtree", 2), health_seen=seen):
      pass
  assert not seen  # it never listened
