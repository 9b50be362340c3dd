"""Checkpoint directories in the HF layout: sharded safetensors + ``config.json``.

``save_kimi`` / ``load_kimi`` read and write the Kimi/DeepSeek-V3 naming of DESIGN §2 (the
multimodal ``language_model.`` prefix of K2.5/K2.6 is detected on load). Shards are read lazily,
one tensor at a time. ``resolve_model_dir`` maps a bundled model's name to its directory.
"""

import json
import os
import re
from pathlib import Path
from typing import Iterable

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from models import hf_io
from models.config import KimiConfig, text_model_config
from models.kimi import KimiModel

BUNDLED_DIR = Path(__file__).parent / "bundled"


def write_sharded(tensors: Iterable[tuple[str, np.ndarray]], out_dir, *, dtype: str = "bfloat16",
                  max_shard_bytes: int = 15 * 2**20, prefix: str = "model") -> list[str]:
  """Writes (name, array) pairs into safetensors shards of at most ``max_shard_bytes``.

  Float tensors are stored in ``dtype``; the router's correction bias stays float32 and INT4
  experts' ``weight_scale`` bf16 (as released).
  Returns the shard file names (an index json maps every tensor to its shard).

  Over an earlier export the old index and its shards are removed first and the new index is
  written last, so an interrupted export leaves a directory that is refused on load (no index),
  never the old index over a mix of old and new shards.
  """
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  index_path = out_dir / f"{prefix}.safetensors.index.json"
  stale = [out_dir / f"{prefix}.safetensors"]
  if index_path.exists():
    try:
      stale += [out_dir / name for name in set(read_json(index_path).get("weight_map", {}).values())
                if isinstance(name, str) and "/" not in name]
    except CheckpointError:
      pass  # an unreadable index: it goes, and the shards it might name are overwritten or left unnamed
    index_path.unlink()
  for path in stale:
    path.unlink(missing_ok=True)
  store = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
  shards: list[dict] = [{}]
  sizes = [0]
  for name, value in tensors:
    value = np.asarray(value)
    if np.issubdtype(value.dtype, np.floating) or value.dtype == ml_dtypes.bfloat16:
      if name.endswith("e_score_correction_bias"):
        value = value.astype(np.float32)
      elif name.endswith("weight_scale"):
        value = value.astype(ml_dtypes.bfloat16)
      else:
        value = value.astype(store)
    if sizes[-1] and sizes[-1] + value.nbytes > max_shard_bytes:
      shards.append({})
      sizes.append(0)
    shards[-1][name] = np.ascontiguousarray(value)
    sizes[-1] += value.nbytes
  names = [f"{prefix}-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  weight_map = {}
  mode = _new_file_mode()
  for file_name, shard in zip(names, shards):
    save_file(shard, str(out_dir / file_name), metadata={"format": "pt"})
    os.chmod(out_dir / file_name, mode)  # safetensors writes 0600; the other files of a checkpoint are not
    weight_map.update({name: file_name for name in shard})
  index = {"metadata": {"total_size": int(sum(sizes))}, "weight_map": weight_map}
  (out_dir / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=1, sort_keys=True))
  return names


def _new_file_mode() -> int:
  """The mode a newly created file gets (0666 less the umask), as ``open`` gives config.json."""
  umask = os.umask(0)
  os.umask(umask)
  return 0o666 & ~umask


class CheckpointError(ValueError):
  """A checkpoint directory that cannot be read as it claims to be; the message names the file."""


def read_json(path: Path) -> dict:
  """A JSON file's object, or a CheckpointError naming the file."""
  try:
    value = json.loads(path.read_text())
  except json.JSONDecodeError as err:
    raise CheckpointError(f"{path}: not valid JSON ({err})") from None
  if not isinstance(value, dict):
    raise CheckpointError(f"{path}: expected a JSON object, got {type(value).__name__}")
  return value


class ShardReader:
  """Lazy access to the tensors of a sharded (or single-file) safetensors checkpoint.

  A missing tensor is a KeyError naming it; an unreadable shard (truncated, not safetensors, not
  holding what the index says) a CheckpointError naming the file.
  """

  def __init__(self, directory, prefix: str = "model"):
    self.directory = Path(directory)
    index = self.directory / f"{prefix}.safetensors.index.json"
    if index.exists():
      weight_map = read_json(index).get("weight_map")
      if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: no weight_map object")
      odd = next((name for name, file_name in weight_map.items() if not isinstance(file_name, str)), None)
      if odd is not None:
        raise CheckpointError(f"{index}: weight_map[{odd!r}] is {weight_map[odd]!r}, not a shard file name")
      self.weight_map = weight_map
    elif (self.directory / f"{prefix}.safetensors").exists():
      self.weight_map = {k: f"{prefix}.safetensors" for k in self._shard(f"{prefix}.safetensors").keys()}
    else:
      raise FileNotFoundError(f"{self.directory} has neither {index.name} nor {prefix}.safetensors")
    self._open: dict = {}

  def _shard(self, file_name: str):
    path = self.directory / file_name
    if not path.is_file():
      raise FileNotFoundError(f"checkpoint shard {path} is missing")
    try:
      return safe_open(str(path), framework="numpy")
    except (SafetensorError, OSError) as err:
      raise CheckpointError(f"{path}: not a readable safetensors file ({err})") from None

  def names(self) -> list[str]:
    return list(self.weight_map)

  def __call__(self, name: str) -> np.ndarray:
    if name not in self.weight_map:
      raise KeyError(name)
    file_name = self.weight_map[name]
    if file_name not in self._open:
      self._open[file_name] = self._shard(file_name)
    try:
      value = self._open[file_name].get_tensor(name)
    except (SafetensorError, OSError) as err:
      raise CheckpointError(f"{self.directory / file_name}: cannot read tensor {name!r} ({err})") from None
    except (AttributeError, TypeError) as err:  # safetensors' numpy reader on a dtype numpy lacks (FP8)
      raise CheckpointError(f"{self.directory / file_name}: cannot read tensor {name!r}: its dtype has no numpy "
                            f"equivalent ({type(err).__name__}: {err}); FP8 checkpoints are not supported") from None
    return value


def save_kimi(model: KimiModel, out_dir, *, dtype: str = "bfloat16", max_shard_bytes: int = 15 * 2**20) -> None:
  """Writes ``config.json`` and HF-named safetensors shards for a Kimi model."""
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  config = model.cfg.to_hf()
  config["torch_dtype"] = dtype
  (out_dir / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
  write_sharded(hf_io.iter_hf_tensors(model), out_dir, dtype=dtype, max_shard_bytes=max_shard_bytes)


def load_kimi(directory, **config_overrides) -> KimiModel:
  """Loads a Kimi/DeepSeek-V3 checkpoint directory (``config.json`` + safetensors).

  ``config_overrides`` replace config fields, e.g. ``dtype="float32", param_dtype="float32"``
  to run a bf16 checkpoint in float32.
  """
  directory = resolve_model_dir(directory)
  config_path = directory / "config.json"
  if not config_path.exists():
    raise FileNotFoundError(f"{directory} has no config.json")
  hf_config = read_json(config_path)
  overrides = {"param_dtype": _stored_dtype(hf_config), "dtype": _stored_dtype(hf_config)}
  overrides.update(config_overrides)
  cfg = KimiConfig.from_hf(hf_config, **overrides)
  reader = ShardReader(directory)
  prefix = hf_io.detect_prefix(reader.names())
  packed_elsewhere = sorted(name for name in reader.names() if name.startswith(prefix) and name.endswith(".weight_packed")
                            and not _EXPERT_TENSOR.match(name[len(prefix):]))
  if packed_elsewhere:  # a scheme whose ignore list leaves more than the routed experts quantised
    raise CheckpointError(
        f"{directory}: {packed_elsewhere[0]}{f' (and {len(packed_elsewhere) - 1} more)' if len(packed_elsewhere) > 1 else ''} "
        "is INT4-packed; only the routed experts may be packed (K2.6's scheme: attention, dense and "
        "shared-expert layers and lm_head stay bf16; compare quantization_config's ignore list with K2.6's)")
  _check_complete(reader, prefix, cfg)
  if not STRUCTURAL_OVERRIDES & set(config_overrides):  # else a deliberate partial load
    unknown = _unaccounted_tensors(reader.names(), prefix, hf_config, cfg)
    if unknown:  # checked by name before anything is read: a 600 GB load fails at once
      raise CheckpointError(
          f"{directory}: {len(unknown)} tensors of the checkpoint are not part of the model its config.json "
          f"describes ({', '.join(unknown[:3])}{', ...' if len(unknown) > 3 else ''}); does config.json match "
          f"the weights (num_hidden_layers={cfg.num_hidden_layers}, n_routed_experts={cfg.n_routed_experts})?")
  return hf_io.load_hf_tensors(cfg, reader, prefix=prefix)


# Overrides that make a model smaller than its checkpoint on purpose (e.g. a few layers of K2.6 for a
# smoke test): the checkpoint's extra tensors are then expected.
STRUCTURAL_OVERRIDES = frozenset({"num_hidden_layers", "n_routed_experts", "first_k_dense_replace", "n_shared_experts",
                                  "tie_word_embeddings"})
_EXPERT_TENSOR = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.\d+\.\w+)\.(weight|weight_packed|weight_scale|weight_shape)$")


def _check_complete(reader: ShardReader, prefix: str, cfg: KimiConfig) -> None:
  """Every tensor the model reads is in the index and every shard holding one exists, checked by name
  before anything is read: a missing shard of a 600 GB checkpoint fails at once, not at its turn.
  Routed experts count in the form the first MoE layer's first expert has (as the loader reads)."""
  names = set(reader.names())
  packed = f"{prefix}model.layers.{cfg.first_k_dense_replace}.mlp.experts.0.gate_proj.weight_packed" in names
  stored = ("weight_packed", "weight_scale", "weight_shape") if packed else ("weight",)
  wanted = []
  for name in hf_io.hf_names(cfg):
    expert = _EXPERT_TENSOR.match(name)
    wanted += [f"{expert.group(1)}.{suffix}" for suffix in stored] if expert else [name]
  wanted = [prefix + name for name in dict.fromkeys(wanted)]
  missing = [name for name in wanted if name not in names]
  if missing:
    raise CheckpointError(
        f"{reader.directory}: {len(missing)} tensors the model needs are not in the checkpoint "
        f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); is the index complete, and does "
        "config.json match the weights?")
  absent = [shard for shard in dict.fromkeys(reader.weight_map[name] for name in wanted)
            if not (reader.directory / shard).is_file()]
  if absent:
    more = f" (and {len(absent) - 1} more shards)" if len(absent) > 1 else ""
    raise FileNotFoundError(f"checkpoint shard {reader.directory / absent[0]} is missing{more}")


def _unaccounted_tensors(names, prefix: str, hf_config: dict, cfg: KimiConfig) -> list[str]:
  """The text model's tensors (under ``prefix``) that a model of ``cfg`` has no place for, beyond
  what a checkpoint may carry unused: the multimodal wrapper's other towers, multi-token-prediction
  layers after the last layer (``num_nextn_predict_layers``), rotary-frequency buffers and, with
  tied embeddings, an ``lm_head.weight``. Routed experts count in either form (bf16 or INT4: each
  loads into the other)."""
  expected = set(hf_io.hf_names(cfg))
  expert_bases = {m.group(1) for m in map(_EXPERT_TENSOR.match, expected) if m}
  configs = (hf_config, hf_config.get("text_config"))  # K2.5/K2.6 nest the text model's config
  mtp_layers = max(int(c.get("num_nextn_predict_layers") or 0) for c in configs if isinstance(c, dict))
  unknown = []
  for name in sorted(names):
    if not name.startswith(prefix):
      continue
    short = name[len(prefix):]
    expert = _EXPERT_TENSOR.match(short)
    if (short in expected or (expert and expert.group(1) in expert_bases) or short.endswith("rotary_emb.inv_freq")
        or (short == "lm_head.weight" and cfg.tie_word_embeddings)):
      continue
    layer = re.match(r"model\.layers\.(\d+)\.", short)
    if layer and cfg.num_hidden_layers <= int(layer.group(1)) < cfg.num_hidden_layers + mtp_layers:
      continue
    unknown.append(name)
  return unknown


def stored_dtype(directory) -> str:
  """The dtype a checkpoint directory's weights are stored in (what ``load_kimi`` uses by default)."""
  return _stored_dtype(read_json(resolve_model_dir(directory) / "config.json"))


def _stored_dtype(hf_config) -> str:
  """The checkpoint's dtype from config.json: ``torch_dtype``, or ``dtype`` as transformers >= 4.56
  writes it (in K2.6's ``text_config`` or at the top); bf16 where neither says."""
  for config in (text_model_config(hf_config), hf_config):
    for key in ("torch_dtype", "dtype"):
      if config.get(key) is not None:
        dtype = str(config[key])
        return dtype if dtype in ("float32", "bfloat16", "float16") else "bfloat16"
  return "bfloat16"


def bundled_models() -> list[str]:
  """Names of the models shipped inside the package."""
  if not BUNDLED_DIR.exists():
    return []
  return sorted(p.name for p in BUNDLED_DIR.iterdir() if (p / "config.json").exists())


def resolve_model_dir(name_or_path) -> Path:
  """A bundled model's name (``kimi-demo``) or a checkpoint directory -> its directory."""
  path = Path(os.path.expanduser(str(name_or_path)))
  if path.is_dir():
    return path
  bundled = BUNDLED_DIR / str(name_or_path)
  if bundled.is_dir():
    return bundled
  known = ", ".join(bundled_models()) or "none"
  raise FileNotFoundError(f"no model directory or bundled model named {str(name_or_path)!r} "
                          f"(bundled: {known})")


def save_dflash(model, out_dir, *, dtype: str = "bfloat16", max_shard_bytes: int = 15 * 2**20) -> None:
  """Writes a DFlash drafter in the published layout (``config.json`` with ``dflash_config``)."""
  from models import dflash  # pylint: disable=import-outside-toplevel
  out_dir = Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  config = model.cfg.to_hf()
  config["torch_dtype"] = dtype
  (out_dir / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
  write_sharded(dflash.to_hf_state_dict(model).items(), out_dir, dtype=dtype, max_shard_bytes=max_shard_bytes)


def load_dflash(directory, **config_overrides):
  """Loads a DFlash drafter directory (``config.json`` + safetensors)."""
  from models import dflash  # pylint: disable=import-outside-toplevel
  directory = resolve_model_dir(directory)
  if not (directory / "config.json").exists():
    raise FileNotFoundError(f"{directory} has no config.json")
  hf_config = read_json(directory / "config.json")
  overrides = {"param_dtype": _stored_dtype(hf_config), "dtype": _stored_dtype(hf_config)}
  overrides.update(config_overrides)
  cfg = dflash.DFlashConfig.from_hf(hf_config, **overrides)
  reader = ShardReader(directory)
  expected = set(dflash.hf_names(cfg))
  if "num_hidden_layers" not in config_overrides:  # else a deliberate partial load
    unknown = sorted(n for n in reader.names() if n not in expected and not n.endswith("rotary_emb.inv_freq"))
    if unknown:  # a drafter cut short by its config would load and only draft badly
      raise CheckpointError(
          f"{directory}: {len(unknown)} tensors of the checkpoint are not part of the drafter its config.json "
          f"describes ({', '.join(unknown[:3])}{', ...' if len(unknown) > 3 else ''}); does config.json match "
          f"the weights (num_hidden_layers={cfg.num_hidden_layers})?")
  return dflash.from_hf_state_dict(cfg, {name: reader(name) for name in reader.names() if name in expected})
