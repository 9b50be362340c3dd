"""Suite-wide set-up: the Mosaic GPU interpreter's callbacks take numpy arrays (see
``tests/interpret_speedup.py``; the interpret-mode files 928 -> 682 test-seconds, same results, checked by
``tests/test_interpret_speedup.py``), and the heaviest files are collected first.

``./dev test`` hands whole files to two xdist workers (``--dist loadfile``) in collection order
(``--no-loadscope-reorder``; xdist's own order, by number of tests, left files of few but long
tests, the notebook's 60 s among them, for the end, where one worker then waits for the other).
Longest first, the two finish together.
"""

import os

# Set before jax starts a backend (it reads XLA_FLAGS then). XLA:CPU splits each executable's code
# generation into parallel modules by default; on the 2-core CI machine, with both cores already
# running a test worker, the split costs more than it saves: one tiny-model decoder compiled in
# 12.4-13.0 CPU-s with one module against 14.4 with the default (2026-12-07), with bit-identical
# logits (the bf16 demo target's and the tiny model's greedy margins compared in float64).
if "xla_cpu_parallel_codegen_split_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_parallel_codegen_split_count=1").strip()
# GPU runs under pytest-xdist: each worker would otherwise claim 75% of the GPU's memory at its first
# allocation, and every test after the first worker's start fails with CUDA_ERROR_OUT_OF_MEMORY.
if os.environ.get("PYTEST_XDIST_WORKER"):
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from tests import interpret_speedup  # pylint: disable=wrong-import-position  # after the flags above

interpret_speedup.install()

# Test-seconds of a default run (2026-12-07, clean clone on a 2-core AVX2 host, 1553 s of pytest with
# the compile log on), heaviest first; only the order matters. Files not listed follow in collection order.
HEAVIEST_FIRST = (
    "tests/pallas_kernels/test_moe.py",  # 468
    "tests/ddtree_jax/test_engine.py",  # 453
    "tests/pallas_kernels/test_tree_attention.py",  # 405
    "tests/serve/test_server.py",  # 235
    "tests/models/test_kimi.py",  # 147
    "tests/ddtree_jax/test_verify.py",  # 132
    "tests/notebooks/test_notebooks.py",  # 128
    "tests/ddtree_jax/test_demo_pair.py",  # 118
    "tests/ddtree_jax/test_policies.py",  # 117
    "tests/models/test_dflash.py",  # 115
    "tests/pallas_kernels/test_tree_attention_window.py",  # 104
    "tests/models/test_int4.py",  # 94
    "tests/ddtree_jax/test_generate_cli.py",  # 91
    "tests/ddtree_jax/test_policy_contract.py",  # 82
    "tests/ddtree_jax/test_logprobs.py",  # 73
    "tests/ddtree_jax/test_train_target.py",  # 67
    "tests/ddtree_jax/test_train_data.py",  # 42
    "tests/benchmarks/test_moe_balance.py",  # 38
    "tests/models/test_row_invariant.py",  # 9 before its batch-padding test (~20 s more)
)


def pytest_collection_modifyitems(config, items):
  del config
  rank = {path: i for i, path in enumerate(HEAVIEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: files stay whole
