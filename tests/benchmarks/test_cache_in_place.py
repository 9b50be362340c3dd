"""``benchmarks/cache_in_place.py``: a timed cell checks what the step wrote, and its table. The steps
here are stand-ins that write the cache as a verify step does (or not): the model's own in-place
write is tested in ``tests/models/test_kimi.py``, and the benchmark runs the model on the GPU."""

import dataclasses
import jax
import pytest

from models.config import KimiConfig
from tests.benchmarks import load_benchmark


@pytest.fixture(scope="module")
def bench():
  return load_benchmark("cache_in_place")


def _writes(slot_shift: int):
  """A step writing the window's rows (its slots shifted by ``slot_shift``) into every layer."""

  def step(model, cache, tokens, positions, visibility, valid, slots):
    rows = cache.c_kv.at[:, (slots + slot_shift)[:, None], positions].set(1.0)
    return dataclasses.replace(cache, c_kv=rows)

  return jax.jit(step, static_argnums=0, donate_argnums=1)


@dataclasses.dataclass(frozen=True)
class _Target:  # what time_step reads of a model
  cfg: KimiConfig


def test_a_cell_checks_the_rows_the_step_wrote(bench):
  model = _Target(KimiConfig.tiny(dtype="float32"))
  row = bench.time_step(_writes(0), model, num_slots=3, columns=40, batch=2, prefix=8, calls=2)
  assert (row["batch"], row["slots"], row["columns"]) == (2, 3, 40)
  # One layer's pool: 4 slots (the scratch slot included) x 40 columns x (latent 32 + rope 16) float32.
  assert row["layer_pool_mb"] == round(4 * 40 * (32 + 16) * 4 / 2**20, 1)
  assert row["wall_ms"] > 0
  with pytest.raises(RuntimeError, match="did not write exactly the window's rows"):
    bench.time_step(_writes(1), model, num_slots=3, columns=40, batch=2, prefix=8, calls=1)


def test_table(bench):
  result = {"model": "demo", "prefix": 512, "device": "NVIDIA H100 80GB HBM3", "form": "in place", "calls": 30,
            "command": "benchmarks/cache_in_place.py --out x", "seconds": 12.0,
            "rows": [dict(impl="pallas", batch=16, slots=64, columns=32768, layer_pool_mb=640.0, wall_ms=1.5)]}
  table = bench.markdown(result)
  assert "| pallas | 16 | 64 | 32768 | 640.0 | 1.500 |" in table
  assert "over 512 committed tokens a slot (NVIDIA H100 80GB HBM3, in place)" in table
  assert "`benchmarks/cache_in_place.py --out x` (12 s)" in table
