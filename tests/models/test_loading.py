"""Checkpoint directories that are not what they claim: every failure names the file or tensor, and
no model is built from part of a checkpoint (tiny target, float32 safetensors written here, CPU)."""

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from models import hf_io, kimi, loading
from models.config import KimiConfig

CFG = KimiConfig.tiny()


@pytest.fixture(scope="module")
def tensors():
  return dict(hf_io.iter_hf_tensors(kimi.init_model(CFG, seed=1)))


def write(directory, tensors, config, max_shard_bytes=100_000):
  loading.write_sharded(tensors.items(), directory, dtype="float32", max_shard_bytes=max_shard_bytes)
  (directory / "config.json").write_text(json.dumps(dict(config, torch_dtype="float32")))
  return directory


def test_a_config_with_fewer_layers_than_the_weights_is_refused(tmp_path, tensors):
  hf = CFG.to_hf()
  write(tmp_path, tensors, hf)
  assert loading.load_kimi(tmp_path).cfg.num_hidden_layers == CFG.num_hidden_layers
  (tmp_path / "config.json").write_text(json.dumps(dict(hf, num_hidden_layers=CFG.num_hidden_layers - 1,
                                                        torch_dtype="float32")))
  last = CFG.num_hidden_layers - 1
  with pytest.raises(loading.CheckpointError, match=f"tensors of the checkpoint are not part of the model.*"
                                                    f"model\\.layers\\.{last}\\..*num_hidden_layers={last}"):
    loading.load_kimi(tmp_path)


def test_what_a_checkpoint_may_carry_unused(tmp_path, tensors):
  """Multi-token-prediction layers after the last layer (when config.json declares them), another
  tower beside ``language_model.``, and rotary buffers load; an MTP-like layer not declared does not."""
  mtp = f"model.layers.{CFG.num_hidden_layers}.eh_proj.weight"
  extra = {mtp: np.zeros((4, 4), np.float32),
           "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}
  write(tmp_path / "mtp", {**tensors, **extra}, dict(CFG.to_hf(), num_nextn_predict_layers=1))
  assert loading.load_kimi(tmp_path / "mtp").cfg.num_hidden_layers == CFG.num_hidden_layers
  write(tmp_path / "undeclared", {**tensors, **extra}, CFG.to_hf())
  with pytest.raises(loading.CheckpointError, match=f"1 tensors .*{mtp}"):
    loading.load_kimi(tmp_path / "undeclared")
  wrapped = {"language_model." + k: v for k, v in tensors.items()}
  wrapped["vision_tower.patch_embed.weight"] = np.zeros((2, 2), np.float32)
  write(tmp_path / "multimodal", wrapped, {"text_config": CFG.to_hf(), "torch_dtype": "float32"})
  assert loading.load_kimi(tmp_path / "multimodal").cfg.num_hidden_layers == CFG.num_hidden_layers


def _write_fp8_safetensors(path, name):
  """A one-tensor safetensors file of dtype F8_E4M3 (the header by hand: numpy cannot write it)."""
  data = bytes([0x38, 0xc0])  # 1.0 and -2.0 in e4m3
  header = json.dumps({name: {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, len(data)]}}).encode()
  header += b" " * (-len(header) % 8)
  path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def test_unreadable_files_are_named(tmp_path, tensors):
  write(tmp_path, tensors, CFG.to_hf())
  shards = sorted(tmp_path.glob("model-*.safetensors"))
  assert len(shards) > 2
  data = shards[1].read_bytes()
  shards[1].write_bytes(data[: len(data) // 2])  # truncated
  with pytest.raises(loading.CheckpointError, match=f"{shards[1].name}: not a readable safetensors file"):
    loading.load_kimi(tmp_path)
  shards[1].write_bytes(data)
  index_path = tmp_path / "model.safetensors.index.json"
  index = json.loads(index_path.read_text())
  name = "model.norm.weight"
  right = index["weight_map"][name]
  index["weight_map"][name] = next(s.name for s in shards if s.name != right)  # listed in the wrong shard
  index_path.write_text(json.dumps(index))
  with pytest.raises(loading.CheckpointError, match=f"cannot read tensor '{name}'"):
    loading.load_kimi(tmp_path)
  _write_fp8_safetensors(tmp_path / "fp8.safetensors", "x")  # as torch writes one; numpy has no such dtype
  with pytest.raises(loading.CheckpointError, match="fp8.safetensors: cannot read tensor 'x': its dtype has no numpy"):
    loading.ShardReader(tmp_path, prefix="fp8")("x")
  index_path.write_text("{\"weight_map\": ")
  with pytest.raises(loading.CheckpointError, match="model.safetensors.index.json: not valid JSON"):
    loading.load_kimi(tmp_path)
  (tmp_path / "config.json").write_text("{\"vocab_size\": 256,")
  with pytest.raises(loading.CheckpointError, match="config.json: not valid JSON"):
    loading.load_kimi(tmp_path)
  (tmp_path / "config.json").write_text("[1, 2]")
  with pytest.raises(loading.CheckpointError, match="config.json: expected a JSON object, got list"):
    loading.load_kimi(tmp_path)
  shards[0].unlink()
  index_path.write_text(json.dumps({"weight_map": {k: shards[0].name for k in tensors}}))
  (tmp_path / "config.json").write_text(json.dumps(dict(CFG.to_hf(), torch_dtype="float32")))
  with pytest.raises(FileNotFoundError, match=f"checkpoint shard .*{shards[0].name} is missing"):
    loading.load_kimi(tmp_path)


def test_an_interrupted_export_over_an_earlier_one_is_refused_not_mixed(tmp_path, tensors, monkeypatch):
  """Re-exporting into a checkpoint directory: the old index and shards go first and the new index
  comes last, so an export stopped after its first shard cannot load as old weights mixed with new."""
  write(tmp_path, tensors, CFG.to_hf())  # an earlier export, several shards
  assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
  newer = {name: value + 1 for name, value in tensors.items()}
  real_save, written = loading.save_file, []

  def save_then_stop(shard, path, **kwargs):
    real_save(shard, path, **kwargs)
    written.append(path)
    if len(written) == 1:
      raise KeyboardInterrupt  # Ctrl-C after the first new shard
  monkeypatch.setattr(loading, "save_file", save_then_stop)
  with pytest.raises(KeyboardInterrupt):
    loading.write_sharded(newer.items(), tmp_path, dtype="float32", max_shard_bytes=50_000)
  assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == [Path(written[0]).name]
  with pytest.raises(FileNotFoundError, match="neither model.safetensors.index.json nor model.safetensors"):
    loading.load_kimi(tmp_path)
  monkeypatch.setattr(loading, "save_file", real_save)
  write(tmp_path, newer, CFG.to_hf(), max_shard_bytes=50_000)  # finished this time: the new weights alone
  loaded = dict(hf_io.iter_hf_tensors(loading.load_kimi(tmp_path, dtype="float32", param_dtype="float32")))
  np.testing.assert_array_equal(loaded["model.norm.weight"], newer["model.norm.weight"])
  assert len(list(tmp_path.glob("model-*.safetensors"))) == len(set(json.loads(
      (tmp_path / "model.safetensors.index.json").read_text())["weight_map"].values()))  # no stale shards
  # Shards readable as the index is (safetensors itself writes 0600: another user could not serve them).
  index_mode = (tmp_path / "model.safetensors.index.json").stat().st_mode & 0o777
  assert {p.stat().st_mode & 0o777 for p in tmp_path.glob("model-*.safetensors")} == {index_mode}


def test_a_deliberately_smaller_model_and_tied_heads_still_load(tmp_path, tensors):
  """Overriding the structure (a few layers of a checkpoint for a smoke test) is a partial load on
  purpose; a tied model's checkpoint may still ship lm_head.weight; INT4-named experts count too."""
  write(tmp_path / "full", tensors, CFG.to_hf())
  fewer = loading.load_kimi(tmp_path / "full", num_hidden_layers=CFG.num_hidden_layers - 1)
  assert fewer.cfg.num_hidden_layers == CFG.num_hidden_layers - 1
  write(tmp_path / "tied", tensors, dict(CFG.to_hf(), tie_word_embeddings=True))
  assert loading.load_kimi(tmp_path / "tied").cfg.tie_word_embeddings


@pytest.mark.parametrize("config, want", [
    ({"torch_dtype": "float32"}, "float32"),
    ({"dtype": "float32"}, "float32"),  # transformers >= 4.56 writes "dtype"
    ({"text_config": {"dtype": "float32"}, "torch_dtype": "bfloat16"}, "float32"),  # K2.6: the text model's own
    ({"text_config": {}, "torch_dtype": "float32"}, "float32"),
    ({}, "bfloat16"),
    ({"torch_dtype": "int8"}, "bfloat16"),
])
def test_stored_dtype_reads_both_spellings(tmp_path, config, want):
  (tmp_path / "config.json").write_text(json.dumps(config))
  assert loading.stored_dtype(tmp_path) == want


def test_missing_tensors_and_shards_are_named_before_anything_is_read(tmp_path, tensors, monkeypatch):
  """A checkpoint lacking tensors (in the index) or shards (on disk) fails by name before the first
  tensor is read, listing how many are missing, not when the loader reaches them; so does a tensor
  missing from an INT4 expert's three."""
  reads = []
  real_call = loading.ShardReader.__call__
  monkeypatch.setattr(loading.ShardReader, "__call__", lambda self, name: reads.append(name) or real_call(self, name))
  write(tmp_path, tensors, CFG.to_hf())
  index_path = tmp_path / "model.safetensors.index.json"
  index = json.loads(index_path.read_text())
  last = CFG.num_hidden_layers - 1
  gone = [f"model.layers.{last}.mlp.experts.{CFG.n_routed_experts - 1}.down_proj.weight", "model.norm.weight"]
  index_path.write_text(json.dumps({"weight_map": {k: v for k, v in index["weight_map"].items() if k not in gone}}))
  with pytest.raises(loading.CheckpointError, match=f"2 tensors the model needs are not in the checkpoint "
                                                    f"\\({gone[0]}, {gone[1]}\\)"):
    loading.load_kimi(tmp_path)
  assert reads == []
  index_path.write_text(json.dumps(index))
  shards = sorted(tmp_path.glob("model-*.safetensors"))
  shards[-1].unlink()
  shards[-2].unlink()
  with pytest.raises(FileNotFoundError, match=f"checkpoint shard .*{shards[-2].name} is missing \\(and 1 more shards\\)"):
    loading.load_kimi(tmp_path)
  assert reads == []
  index_path.write_text('{"weight_map": {"model.norm.weight": 7}}')
  with pytest.raises(loading.CheckpointError, match="weight_map\\['model.norm.weight'\\] is 7, not a shard file name"):
    loading.load_kimi(tmp_path)


def test_integer_weights_are_refused_by_name(tmp_path, tensors):
  """Integer bytes where float weights belong (a raw FP8 export, a packed tensor under a bf16 name)
  would otherwise load as numbers."""
  name = "model.layers.1.self_attn.q_b_proj.weight"
  write(tmp_path, {**tensors, name: tensors[name].view(np.int32)}, CFG.to_hf())
  with pytest.raises(ValueError, match=f"tensor '{name}' is int32, expected floating-point weights"):
    loading.load_kimi(tmp_path)
