"""Suite-wide set-up: the Mosaic GPU interpreter's callbacks take numpy arrays (see
``tests/interpret_speedup.py``; the interpret-mode files 928 -> 682 test-seconds, same results, checked by
``tests/test_interpret_speedup.py``), and the heaviest files are collected first.

``./dev test`` hands whole files to two xdist workers (``--dist loadfile``) in collection order
(``--no-loadscope-reorder``; xdist's own order, by number of tests, left files of few but long
tests, the notebook's 60 s among them, for the end, where one worker then waits for the other).
Longest first, the two finish together.
"""

from tests import interpret_speedup

interpret_speedup.install()

# Test-seconds of a default run (2026-12-06, 2-core CPU), heaviest first; only the order matters.
# Files not listed follow in collection order.
HEAVIEST_FIRST = (
    "tests/pallas_kernels/test_moe.py",  # 360
    "tests/ddtree_jax/test_engine.py",  # 308
    "tests/pallas_kernels/test_tree_attention.py",  # 294
    "tests/serve/test_server.py",  # 152
    "tests/models/test_kimi.py",  # 122
    "tests/ddtree_jax/test_demo_pair.py",  # 73
    "tests/pallas_kernels/test_tree_attention_window.py",  # 69
    "tests/notebooks/test_notebooks.py",  # 68
    "tests/models/test_dflash.py",  # 68
    "tests/ddtree_jax/test_verify.py",  # 67
    "tests/models/test_int4.py",  # 55
    "tests/ddtree_jax/test_train_target.py",  # 55
    "tests/ddtree_jax/test_generate_cli.py",  # 52
    "tests/ddtree_jax/test_policy_contract.py",  # 48
    "tests/ddtree_jax/test_policies.py",  # 43
    "tests/ddtree_jax/test_train_data.py",  # 25 (2026-12-07: the drafter command's end-to-end run)
)


def pytest_collection_modifyitems(config, items):
  del config
  rank = {path: i for i, path in enumerate(HEAVIEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: files stay whole
