"""Server settings: the kernel switches (``--attention-impl``, ``--moe-impl``) reach the model, and
asking for a Pallas kernel where it cannot run fails at startup with a message naming it."""

import os
import subprocess
import sys

import pytest

from ddtree_jax import serve as serve_cli
from models import loading
from serve import config as serve_config
from serve.config import ServeConfig
from serve.launch import ServerThread


def test_bad_kernel_impls_are_refused_by_name():
  for name in ("attention_impl", "moe_impl"):
    with pytest.raises(ValueError, match=f"{name} 'triton': expected one of"):
      ServeConfig(**{name: "triton"})


def test_bad_expert_format_is_refused_by_name(capsys):
  with pytest.raises(ValueError, match=r"experts 'fp8': expected one of \('auto', 'int4', 'dense'\)"):
    ServeConfig(experts="fp8")
  with pytest.raises(SystemExit) as exit_info:
    serve_cli.parse_args(["--experts", "fp8"])
  assert exit_info.value.code == 2
  assert "argument --experts: invalid choice: 'fp8'" in capsys.readouterr().err


def test_max_logprobs_reaches_the_config_and_is_bounded(capsys):
  assert serve_cli.parse_args([])[0].max_logprobs == 5
  assert serve_cli.parse_args(["--max-logprobs", "-1"])[0].max_logprobs == -1
  assert serve_cli.parse_args(["--max-logprobs", "20"])[0].max_logprobs == 20
  for bad in (-2, 21):
    with pytest.raises(ValueError, match=rf"max_logprobs must lie in \[-1, 20\] .*got {bad}"):
      ServeConfig(max_logprobs=bad)
  with pytest.raises(SystemExit) as exit_info:
    serve_cli.parse_args(["--max-logprobs", "50"])
  assert exit_info.value.code == 2 and "max_logprobs must lie in [-1, 20]" in capsys.readouterr().err


def test_batch_buckets_flag_sets_the_compiled_sizes_and_is_checked(capsys):
  assert serve_cli.parse_args([])[0].buckets == (1, 2, 4, 8, 16)
  assert serve_cli.parse_args(["--max-batch", "12"])[0].buckets == (1, 2, 4, 8, 12)
  config = serve_cli.parse_args(["--batch-buckets", "1,4,24"])[0]  # the largest bucket sets max_batch
  assert (config.buckets, config.max_batch) == ((1, 4, 24), 24)
  assert serve_cli.parse_args(["--batch-buckets", "2,8", "--max-batch", "8"])[0].buckets == (2, 8)
  for flags, message in ((["--batch-buckets", "1,4,16", "--max-batch", "8"],
                          "the largest bucket must be --max-batch (8), got 16"),
                         (["--batch-buckets", "1,x"], "expected comma-separated batch sizes"),
                         (["--batch-buckets", ""], "expected comma-separated batch sizes"),
                         (["--batch-buckets", "4,2,8"], "batch sizes must increase"),
                         (["--batch-buckets", "4,4"], "batch sizes must increase"),
                         (["--batch-buckets", "0,4"], "batch sizes must be positive")):
    with pytest.raises(SystemExit) as exit_info:
      serve_cli.parse_args(flags)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--batch-buckets" in err and message in err, (flags, err)
  with pytest.raises(ValueError, match=r"the largest bucket must be --max-batch \(16\), got 4"):
    ServeConfig(batch_buckets="1,4")


def test_pallas_needs_a_gpu_backend():
  ServeConfig().check_backend("cpu")  # xla runs anywhere
  for name in ("attention_impl", "moe_impl"):
    config = ServeConfig(**{name: "pallas"})
    config.check_backend("gpu")
    with pytest.raises(ValueError, match=f"{name}='pallas' .* needs a GPU backend, not 'cpu'"):
      config.check_backend("cpu")


def test_cli_flags_set_the_kernels(monkeypatch):
  monkeypatch.setattr(serve_config.jax, "default_backend", lambda: "gpu")
  config, _ = serve_cli.parse_args(["--attention-impl", "pallas", "--moe-impl", "pallas"])
  assert (config.attention_impl, config.moe_impl) == ("pallas", "pallas")
  config, _ = serve_cli.parse_args([])
  assert (config.attention_impl, config.moe_impl, config.experts) == ("xla", "xla", "auto")
  config, _ = serve_cli.parse_args(["--experts", "int4"])
  assert config.experts == "int4"


def test_cli_refuses_pallas_off_the_gpu(monkeypatch, capsys):
  monkeypatch.setattr(serve_config.jax, "default_backend", lambda: "cpu")
  with pytest.raises(SystemExit) as exit_info:
    serve_cli.parse_args(["--moe-impl", "pallas"])
  assert exit_info.value.code == 2
  assert "moe_impl='pallas' runs a Mosaic GPU kernel and needs a GPU backend, not 'cpu'" in capsys.readouterr().err


def test_the_server_exits_at_startup_when_pallas_cannot_run():
  """The real entry point on this CPU machine: a clear error and exit code 2 before any model loads."""
  proc = subprocess.run([sys.executable, "-m", "ddtree_jax.serve", "--attention-impl", "pallas", "--port", "0"],
                        capture_output=True, text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 2
  assert "attention_impl='pallas' runs a Mosaic GPU kernel and needs a GPU backend" in proc.stderr


def test_pallas_kernels_are_refused_for_a_float32_model(monkeypatch, tmp_path):
  """Both kernels multiply in bf16: a float32 server with them would not be float32-exact."""
  for name in ("attention_impl", "moe_impl"):
    with pytest.raises(ValueError, match=f"{name}='pallas' computes in bfloat16, so a float32 model"):
      ServeConfig(dtype="float32", **{name: "pallas"})
    ServeConfig(dtype="bfloat16", **{name: "pallas"})
  # --dtype auto takes the checkpoint's: refused once its config.json is read, before any weights.
  from models import kimi
  from models.config import KimiConfig
  loading.save_kimi(kimi.init_model(KimiConfig.tiny(num_hidden_layers=1), seed=0), tmp_path, dtype="float32")
  monkeypatch.setattr(serve_config.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(loading, "load_kimi", lambda *a, **k: pytest.fail("weights loaded"))
  with pytest.raises(ValueError, match="attention_impl='pallas' .* stored in float32: pass --dtype bfloat16"):
    serve_config.build_engine(ServeConfig(model=str(tmp_path), attention_impl="pallas"))


def test_build_engine_passes_the_kernels_to_the_target(monkeypatch):
  seen = {}

  class Stop(Exception):
    pass

  def load_kimi(directory, **overrides):
    seen.update(overrides)
    raise Stop

  monkeypatch.setattr(serve_config.jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(loading, "load_kimi", load_kimi)
  with pytest.raises(Stop):
    serve_config.build_engine(ServeConfig(attention_impl="pallas", moe_impl="pallas", dtype="bfloat16"))
  assert seen == {"dtype": "bfloat16", "param_dtype": "bfloat16", "attention_impl": "pallas", "moe_impl": "pallas"}
  for experts, overrides in (("int4", {"experts_int4": True}), ("dense", {"experts_int4": False}), ("auto", {})):
    seen.clear()
    with pytest.raises(Stop):
      serve_config.build_engine(ServeConfig(experts=experts, dtype="bfloat16"))
    assert seen == {"dtype": "bfloat16", "param_dtype": "bfloat16", "attention_impl": "xla", "moe_impl": "xla",
                    **overrides}, experts


def test_server_thread_refuses_pallas_off_the_gpu_before_it_starts(monkeypatch):
  monkeypatch.setattr(serve_config.jax, "default_backend", lambda: "cpu")
  with pytest.raises(ValueError, match="moe_impl='pallas' runs a Mosaic GPU kernel"):
    ServerThread(ServeConfig(port=0, moe_impl="pallas"))


def test_policy_options_are_checked_and_reach_the_decoder(monkeypatch, capsys):
  config, _ = serve_cli.parse_args(["--spec", "beam", "--policy-option", "width=3"])
  assert config.policy_options == {"width": 3}
  for argv, message in ((["--spec", "beam", "--policy-option", "widht=3"],
                         "policy 'beam' got unknown options ['widht']; it accepts ['width']"),
                        (["--spec", "none", "--policy-option", "width=3"], "policy options given with spec 'none'"),
                        (["--policy-option", "width=3", "--policy-option", "width=4", "--spec", "beam"],
                         "--policy-option width given twice")):
    with pytest.raises(SystemExit) as exit_info:
      serve_cli.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
  seen = {}

  class Stop(Exception):
    pass

  def decoder(*args, **kwargs):
    seen.update(kwargs)
    raise Stop
  monkeypatch.setattr(serve_config.engine, "SpeculativeDecoder", decoder)
  with pytest.raises(Stop):
    serve_config.build_engine(config)
  assert seen["policy"] == "beam" and seen["policy_options"] == {"width": 3}


def test_max_stop_ids_flag_and_a_model_with_more_stop_ids_refused_at_startup(monkeypatch):
  config, _ = serve_cli.parse_args(["--max-stop-ids", "3"])
  assert config.max_stop_ids == 3
  # The bundled pair's own stop ids are EOS and <|im_end|>: one slot is too few for chat requests.
  monkeypatch.setattr(serve_config.engine, "SpeculativeDecoder", lambda *a, **k: pytest.fail("compiled"))
  with pytest.raises(ValueError, match=r"the model's own stop ids \(2: .*\) exceed --max-stop-ids 1"):
    serve_config.build_engine(ServeConfig(max_stop_ids=1, spec="none"))


def test_the_server_exits_when_its_model_does_not_load(tmp_path):
  """A warm-up that fails ends the process with status 1 and the error, rather than a server that
  answers 503 forever (a supervisor must see a failed start)."""
  proc = subprocess.run([sys.executable, "-m", "ddtree_jax.serve", "--model", str(tmp_path / "missing"), "--port", "0",
                         "--log-level", "warning"], capture_output=True, text=True, timeout=300,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 1, proc.stderr[-2000:]
  assert "warm-up failed" in proc.stderr and "no model directory or bundled model named" in proc.stderr


def test_the_server_exits_with_3_when_its_port_is_taken():
  import socket
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "ddtree_jax.serve", "--port", str(port), "--spec", "none",
                           "--log-level", "warning"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 3, proc.stderr[-2000:]


def test_an_out_of_range_port_is_refused(capsys):
  with pytest.raises(SystemExit) as exit_info:
    serve_cli.parse_args(["--port", "99999"])
  assert exit_info.value.code == 2
  assert "port must lie in [0, 65535], got 99999" in capsys.readouterr().err


def test_a_context_past_the_models_positions_is_refused_by_its_flag():
  with pytest.raises(ValueError, match="--max-context 5000 exceeds the model's max_position_embeddings 4096"):
    serve_config.build_engine(ServeConfig(max_context=5000, dtype="float32"))
