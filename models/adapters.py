"""A PEFT LoRA adapter folder read as PEFT reads it, its tensors mapped onto our linears.

A folder holds `adapter_config.json` (PEFT's LoraConfig) and `adapter_model.safetensors`, whose
tensors are named after the base model's modules: `base_model.model.<module>.lora_A.weight`
[r, in] and `<module>.lora_B.weight` [out, r]. PEFT adds (x A^T) B^T * scale to that module's
output, scale = lora_alpha / r (lora_alpha / sqrt(r) with `use_rslora`), r and lora_alpha
overridden per module by `rank_pattern` / `alpha_pattern` (a pattern matches a module whose
name ends in it at a dot boundary, as PEFT's get_pattern_key matches).

Each pair becomes an update of one of our linears: the module's weight name goes through the
model's own checkpoint map, the one its base weights load by, so a module we fuse (q_proj
inside our qkv_proj, gate_proj inside gate_up_proj) updates just its rows. The scale is folded
into B. Settings of LoraConfig we do not implement (DoRA, biases, modules to save, ...) are
refused with the file, the field and the value named, as a checkpoint's settings are; the
module names the targets come from are the tensors themselves (target_modules only chose them
when the adapter was made).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from models.checkpoint import CheckpointError, Found, Schema, Settings, read_settings
from models.loader import Shard, read_safetensors

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."

# PEFT 0.21's LoraConfig. `defaults`: what the update is computed from; `fixed`: options that
# change what is computed, accepted at their off value only; `inert`: what only mattered while
# the adapter was made (which modules it targets, how it was initialised, dropout) or is
# metadata.
LORA_CONFIG = Schema("LoraConfig", {
    "r": 8, "lora_alpha": 8, "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {},
}, fixed={
    "peft_type": "LORA", "bias": "none", "use_dora": False, "fan_in_fan_out": False,
    "lora_bias": False, "modules_to_save": None, "layer_replication": None,
    "trainable_token_indices": None, "alora_invocation_tokens": None,
    "target_parameters": None, "use_qalora": False, "use_bdlora": None, "arrow_config": None,
    "kasa_config": None, "monteclora_config": None, "velora_config": None,
    "ensure_weight_tying": False, "megatron_config": None,
}, inert=frozenset({
    "target_modules", "exclude_modules", "layers_to_transform", "layers_pattern",
    "lora_dropout", "init_lora_weights", "loftq_config", "eva_config", "corda_config",
    "lora_ga_config", "base_model_name_or_path", "revision", "task_type", "inference_mode",
    "auto_mapping", "peft_version", "megatron_core", "qalora_group_size", "runtime_config",
}))


@dataclass(frozen=True)
class LoraPart:
    """One update of one of our linears: rows [first, first + b.shape[0]) of its output get
    (x A^T) B^T, the scale already in B."""

    module: str  # our linear's name, e.g. "layers.0.self_attn.qkv_proj"
    first: int
    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [rows, r], scaled


@dataclass(frozen=True)
class LoraAdapter:
    """A PEFT LoRA adapter read from `path`, as updates of our linears."""

    name: str
    path: Path
    parts: tuple[LoraPart, ...]
    settings: Settings

    @property
    def rank(self) -> int:
        return max(p.a.shape[0] for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for p in self.parts)

    def describe(self) -> str:
        """"r=16, 8 linears, 0.3 MiB" for logs and panels."""
        modules = len({p.module for p in self.parts})
        return f"r={self.rank}, {modules} linears, {self.nbytes / 2**20:.1f} MiB"


WeightMap = Callable[[str], "tuple[str, Shard | None] | None"]


def read_adapter(name: str, path: Path, weight_map: WeightMap) -> LoraAdapter:
    """The adapter at `path` (a PEFT folder), its modules mapped by the base model's
    `weight_map` (checkpoint weight name -> our parameter and row shard). Raises
    CheckpointError naming the file and what is wrong."""
    path = Path(path)
    settings = read_lora_config(path)
    weights = path / WEIGHTS
    if not weights.exists():
        bin_file = path / "adapter_model.bin"
        raise CheckpointError(f"{path}: no {WEIGHTS}" + (
            " (adapter_model.bin is a pickle, which mmserve does not read)"
            if bin_file.exists() else ""))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in read_safetensors(weights):
        module, kind = _split_key(key, weights)
        pairs.setdefault(module, {})[kind] = tensor
    if not pairs:
        raise CheckpointError(f"{weights}: no LoRA tensors")
    parts = []
    for module, pair in sorted(pairs.items()):
        if set(pair) != {"lora_A", "lora_B"}:
            raise CheckpointError(f"{weights}: {module} has {sorted(pair)} but needs both "
                                  "lora_A and lora_B")
        parts.append(_part(module, pair["lora_A"], pair["lora_B"], settings, weight_map,
                           weights))
    return LoraAdapter(name, path, tuple(parts), settings)


def read_lora_config(path: Path) -> Settings:
    """adapter_config.json against LORA_CONFIG. Options a newer PEFT added are accepted only at
    an off value (None, False or empty)."""
    file = Path(path) / CONFIG
    if not file.exists():
        raise CheckpointError(f"{path}: no {CONFIG} (not a PEFT adapter folder)")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from e
    known = {*LORA_CONFIG.defaults, *LORA_CONFIG.fixed, *LORA_CONFIG.inert}
    data = {k: None if v in ([], {}) and k in LORA_CONFIG.fixed else v for k, v in data.items()
            if k in known or v not in (None, False, [], {})}
    settings = read_settings(Found(data, str(file)), LORA_CONFIG)
    for key in ("r", "lora_alpha"):
        value = settings[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise CheckpointError(f"{file}: {key}={value!r} must be a positive number")
    return settings


def _split_key(key: str, file: Path) -> tuple[str, str]:
    """"base_model.model.model.layers.0.mlp.down_proj.lora_A.weight" ->
    ("model.layers.0.mlp.down_proj", "lora_A")."""
    if not key.startswith(PREFIX) or not key.endswith(".weight"):
        raise CheckpointError(f"{file}: tensor {key} is not a PEFT LoRA weight "
                              f"({PREFIX}<module>.lora_A.weight / .lora_B.weight)")
    module, _, kind = key[len(PREFIX):-len(".weight")].rpartition(".")
    if kind not in ("lora_A", "lora_B"):
        raise CheckpointError(f"{file}: tensor {key} is not supported (LoRA on linears only: "
                              "lora_A / lora_B; embeddings' lora_embedding_* are not)")
    return module, kind


def _part(module: str, a: torch.Tensor, b: torch.Tensor, settings: Settings,
          weight_map: WeightMap, file: Path) -> LoraPart:
    rank = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank:
        raise CheckpointError(f"{file}: {module} has lora_A {tuple(a.shape)} and lora_B "
                              f"{tuple(b.shape)}, not [r, in] and [out, r]")
    r = _pattern_value(settings["rank_pattern"], module, settings["r"])
    alpha = _pattern_value(settings["alpha_pattern"], module, settings["lora_alpha"])
    if r != rank:
        raise CheckpointError(f"{file}: {module} has rank {rank} but {CONFIG} says r={r}")
    scale = alpha / math.sqrt(r) if settings["use_rslora"] else alpha / r
    target = weight_map(module + ".weight")
    if target is None:
        raise CheckpointError(f"{file}: {module} is not a linear of this model's weights "
                              "(its base weight is not one we load)")
    ours, shard = target
    if not ours.endswith(".weight"):
        raise CheckpointError(f"{file}: {module} maps to {ours}, not a linear's weight")
    if shard is not None and shard.size != b.shape[0]:
        raise CheckpointError(f"{file}: {module}'s lora_B has {b.shape[0]} rows but the "
                              f"module has {shard.size}")
    first = 0 if shard is None else shard.start
    return LoraPart(ours[: -len(".weight")], first, a.float(), b.float() * scale)


def _pattern_value(patterns: Mapping[str, float], module: str, default: float) -> float:
    """PEFT's get_pattern_key: the first pattern that `module` ends with at a dot boundary."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default
