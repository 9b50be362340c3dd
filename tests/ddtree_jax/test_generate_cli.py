"""``python -m ddtree_jax.generate``: a short run on the CPU decodes speculatively and plainly and
reports the streams identical; bad arguments, a Pallas kernel off the GPU included, are refused
by name before any model loads."""

import pytest

from ddtree_jax import generate


def test_a_short_greedy_run_is_identical_to_plain_decoding(capsys):
  code = generate.main(["--max-new-tokens", "12", "--budget", "4", "--prompt", "import json"])
  out = capsys.readouterr().out
  assert code == 0
  assert out.startswith("import json")
  assert "kimi-demo + kimi-demo-dflash, policy ddtree, budget 4, float32: 12 tokens" in out
  assert "speculative output identical (greedy)" in out


@pytest.mark.parametrize("args,message", [
    (["--moe-impl", "pallas"], "moe_impl='pallas' runs a Mosaic GPU kernel and needs a GPU backend, not 'cpu'"),
    (["--attention-impl", "pallas"], "attention_impl='pallas' runs a Mosaic GPU kernel and needs a GPU backend"),
    (["--attention-impl", "triton"], "invalid choice: 'triton'"),
    (["--budget", "-1"], "--budget out of range: -1"),
    (["--top-p", "0"], "--top-p out of range: 0.0"),
])
def test_bad_arguments_are_refused_by_name(capsys, args, message):
  with pytest.raises(SystemExit) as exit_info:
    generate.main(args)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err
