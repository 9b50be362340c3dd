"""``benchmarks/tune_moe.py``'s "prep" variant (the call's plain-jnp part alone, for timing): it
builds the work list the call would (rows per item from the format's rule) and takes A rows as the
take back from the work layout does (from x_sorted itself, at the rows' columns), zeros past the
routed rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import moe
from tests.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def tune():
  return load_benchmark("tune_moe")


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_prep_only_builds_the_calls_work_list_and_take(tune, fmt, monkeypatch):
  x = jax.random.normal(jax.random.key(0), (40, 16), jnp.bfloat16)
  sizes = jnp.asarray([17, 0, 9, 6], jnp.int32)  # 32 routed rows, 8 padding
  w = moe.Int4Experts(None, None, None) if fmt == "int4" else moe.Bf16Experts(None, None, None)
  seen = []
  work_list = moe.work_list
  monkeypatch.setattr(moe, "work_list", lambda g, a, r: seen.append(r) or work_list(g, a, r))
  got = np.asarray(tune.prep_only(x, sizes, w), np.float32)
  rows = tune.bench_moe.expected_rows(x, sizes)
  r = moe.default_block_rows(4, rows, is_int4=fmt == "int4")
  assert seen == [r]
  columns = np.minimum(np.asarray(work_list(sizes, 40, r).row_column)[:32], 39)
  np.testing.assert_array_equal(got[:32], np.asarray(x, np.float32)[columns])
  assert (got[32:] == 0).all() and len(set(columns.tolist())) > 1
