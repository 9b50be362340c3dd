"""``benchmarks/moe_waves.py``: its tables put every measurement in its variant's row, in item order;
``moe_dead_tail.py`` refuses to run off the GPU."""

import pytest

from tests.benchmarks import load_benchmark, run_main


@pytest.fixture(scope="module")
def waves():
  return load_benchmark("moe_waves")


def test_markdown_rows_follow_variants_and_item_counts(waves):
  sweep = []
  for fmt, label, base in (("int4", "registers (default), 2 stages", 100.0), ("bf16", "default (4 stages)", 500.0)):
    for n in (8, 1, 4):  # out of order: the table sorts the counts
      sweep.append(dict(format=fmt, variant=label, items=n, gate_up_us=base + n, down_us=base / 10 + n,
                        gate_up_weight_tb_s=n / 10))
  dead = [dict(format="int4", tokens=9, variant="every row routed elsewhere", item_slots=73, mean_live_items=8.1,
               time_us=22.5, gate_up_us=5.4, down_us=7.9, glue_us=9.2)]
  text = waves.markdown(dict(device="NVIDIA H200", jax="0.11.2", command="cmd", seconds=1.0, sweep=sweep, dead=dead))
  lines = text.splitlines()
  assert "| format | variant | kernel | n=1 | n=4 | n=8 |" in lines
  assert ("| int4 | registers (default), 2 stages | gate/up | 101.0 (0.10 TB/s) | 104.0 (0.40 TB/s) | "
          "108.0 (0.80 TB/s) |") in lines
  assert "| int4 | registers (default), 2 stages | down | 11.0 | 14.0 | 18.0 |" in lines
  assert "| bf16 | default (4 stages) | down | 51.0 | 54.0 | 58.0 |" in lines
  assert "| int4 | 9 | every row routed elsewhere | 73 | 8.1 | 22.5 | 5.4 | 7.9 | 9.2 |" in lines


def test_refuses_to_run_off_the_gpu(waves, monkeypatch):
  with pytest.raises(SystemExit, match="GPU"):
    run_main(monkeypatch, waves)


def test_dead_tail_script_refuses_to_run_off_the_gpu():
  with pytest.raises(SystemExit, match="GPU"):
    load_benchmark("moe_dead_tail").main()
