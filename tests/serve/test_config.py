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
  assert (config.attention_impl, config.moe_impl) == ("xla", "xla")


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


def test_server_thread_refuses_pallas_off_the_gpu_before_it_starts(monkeypatch):
  monkeypatch.setattr(serve_config.jax, "default_backend", lambda: "cpu")
  with pytest.raises(ValueError, match="moe_impl='pallas' runs a Mosaic GPU kernel"):
    ServerThread(ServeConfig(port=0, moe_impl="pallas"))
