"""``python -m ddtree_jax.generate``: a short run on the CPU decodes speculatively and plainly and
reports the streams identical; bad arguments, a Pallas kernel off the GPU included, are refused
by name before any model loads."""

import numpy as np
import pytest

from ddtree_jax import engine, generate, near_tie


SHORT_RUN = ["--max-new-tokens", "12", "--budget", "4", "--prompt", "import json"]


def test_a_short_greedy_run_is_identical_to_plain_decoding(capsys):
  code = generate.main(SHORT_RUN)
  out = capsys.readouterr().out
  assert code == 0
  assert out.startswith("import json")
  assert "kimi-demo + kimi-demo-dflash, policy ddtree, budget 4, float32: 12 tokens" in out
  assert "speculative output identical (greedy)" in out


def test_differing_greedy_streams_are_judged_by_the_near_tie_rule(capsys, monkeypatch):
  """A speculative stream that leaves greedy decoding (one token swapped here) is judged against an
  engine-independent greedy decoding: exit 1 and 'NOT a near tie' where the margin is above the
  tolerance (the allowed verdict below the tolerance: ``test_near_tie_report_...``), and the plain
  decoding equals the reference's. The short run's arguments, so that its compiled steps serve."""
  real_generate = engine.SpeculativeDecoder.generate

  def swap_a_token(self, *args, **kwargs):
    result = real_generate(self, *args, **kwargs)
    if self.budgets != (0,):
      result.tokens[0][3] = (result.tokens[0][3] + 1) % self.target.cfg.vocab_size
    return result

  monkeypatch.setattr(engine.SpeculativeDecoder, "generate", swap_a_token)
  code = generate.main(SHORT_RUN)
  out = capsys.readouterr().out
  assert code == 1
  assert "budget 4, float32: 12 tokens in " in out
  assert "speculative output DIFFERENT (greedy)" in out
  assert "plain output equals greedy decoding one token a step" in out
  line = next(l for l in out.splitlines() if l.startswith("speculative output first differs"))
  assert "at token 3, where its top-2 logit margin is" in line and line.endswith("NOT a near tie (>= 0.0001 in float32)")


def test_near_tie_report_cuts_the_reference_at_the_stop_and_catches_a_short_stream(capsys, monkeypatch):
  """Against a stubbed reference [1, 2, 3, stop, 8, 9] (margins 0.5 except 1e-4 at token 2, the
  float32 tolerance itself): a stream stopping where it stops is equal; one ending early is not
  excused; a difference at a margin equal to the tolerance is not a near tie, one below it is."""
  stop = 7
  monkeypatch.setattr(near_tie, "greedy_reference", lambda target, prompts, new, max_len: (
      [[1, 2, 3, stop, 8, 9][:new]], [np.array([0.5, 0.5, 1e-4, 0.5, 0.5, 0.5])[:new]]))
  report = lambda spec, plain: generate.near_tie_report(None, [0], spec, plain, "float32", (99, stop), 6, 16)
  assert report([1, 2, 3, stop], [1, 2, 3, stop])
  assert "speculative output equals greedy decoding" in capsys.readouterr().out
  assert not report([1, 2, 3], [1, 2, 3, stop])
  out = capsys.readouterr().out
  assert "speculative output ends after 3 tokens where greedy decoding one token a step has 4" in out
  assert "plain output equals greedy decoding" in out
  assert not report([1, 2, 5, stop], [1, 2, 3, stop])
  assert "at token 2, where its top-2 logit margin is 0.0001: NOT a near tie" in capsys.readouterr().out
  assert report([1, 2, 3, stop], [1, 4, 3, stop])  # the plain engine's divergence is reported, not fatal
  assert "plain output first differs from greedy decoding one token a step at token 1" in capsys.readouterr().out
  monkeypatch.setitem(near_tie.TOLERANCE, "float32", 1.0)  # above the 0.5 margins
  assert report([1, 9, 3, stop], [1, 2, 3, stop])
  assert ("speculative output first differs from greedy decoding one token a step at token 1, where its top-2 "
          "logit margin is 0.5: a near tie (< 1.0 in float32), allowed") in capsys.readouterr().out


def test_a_drafter_of_another_target_names_both_flags(tmp_path, capsys):
  from models import kimi, loading
  from models.config import KimiConfig
  loading.save_kimi(kimi.init_model(KimiConfig.tiny(), seed=0), tmp_path / "tiny")
  with pytest.raises(SystemExit) as exit_info:
    generate.main(["--model", str(tmp_path / "tiny"), "--prompt", "x"])  # the default drafter is the demo's
  assert exit_info.value.code == 2
  assert f"--drafter kimi-demo-dflash does not fit --model {tmp_path / 'tiny'}: " in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--moe-impl", "pallas"], "moe_impl='pallas' runs a Mosaic GPU kernel and needs a GPU backend, not 'cpu'"),
    (["--attention-impl", "pallas"], "attention_impl='pallas' runs a Mosaic GPU kernel and needs a GPU backend"),
    (["--attention-impl", "triton"], "invalid choice: 'triton'"),
    (["--experts", "fp8"], "argument --experts: invalid choice: 'fp8'"),
    (["--budget", "-1"], "--budget out of range: -1"),
    (["--top-p", "0"], "--top-p out of range: 0.0"),
    (["--temperature", "inf"], "--temperature out of range: inf"),  # once refused only after compiling
    (["--seed", "-1"], "--seed out of range: -1"),
])
def test_bad_arguments_are_refused_by_name(capsys, args, message):
  with pytest.raises(SystemExit) as exit_info:
    generate.main(args)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


def test_an_unreadable_checkpoint_is_a_usage_error_naming_the_file(capsys, tmp_path):
  from models import kimi, loading
  from models.config import KimiConfig
  loading.save_kimi(kimi.init_model(KimiConfig.tiny(), seed=0), tmp_path, dtype="float32", max_shard_bytes=100_000)
  shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
  shard.write_bytes(shard.read_bytes()[:100])
  with pytest.raises(SystemExit) as exit_info:
    generate.main(["--model", str(tmp_path)])
  assert exit_info.value.code == 2
  assert f"{shard.name}: not a readable safetensors file" in capsys.readouterr().err


def test_policy_options_reach_the_policy(capsys, monkeypatch):
  """Also with the target's experts quantised on load (``--experts int4``, the bf16 demo checkpoint),
  and with more stop ids than the engine's default room for them (a checkpoint listing five EOS ids:
  special ids the demo model never emits, so the 8 tokens still come)."""
  from serve.text import TextCodec
  read_codec = TextCodec.from_model_dir

  def five_stop_ids(*args, **kwargs):
    codec = read_codec(*args, **kwargs)
    codec.stop_ids = codec.stop_ids + (2, 3, 4, 5)
    return codec
  monkeypatch.setattr(TextCodec, "from_model_dir", five_stop_ids)
  code = generate.main(["--max-new-tokens", "8", "--policy", "beam", "--policy-option", "width=2", "--budget", "4",
                        "--prompt", "import os", "--no-compare", "--experts", "int4"])
  assert code == 0
  assert "policy beam, budget 4, float32, INT4 experts: 8 tokens" in capsys.readouterr().out
  for args, message in ((["--policy-option", "widht=2", "--policy", "beam"],
                         "policy 'beam' got unknown options ['widht']; it accepts ['width']"),
                        (["--policy-option", "width"], "--policy-option 'width': expected NAME=VALUE"),
                        (["--policy-option", "width=0", "--policy", "beam"], "width")):
    with pytest.raises(SystemExit) as exit_info:
      generate.main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
