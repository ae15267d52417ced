"""The engine's memory at start-up, beside the weights: the context it serves, the KV-cache
budget and its blocks, the KV pools of the attention layers and the recurrent-state pools of a
hybrid model's linear-attention layers.

Values derived here from the options, the model and the device (the number of blocks, the
effective `max_model_len`) live in the layouts, never written back into EngineConfig.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine import kv_pool
from engine.config import EngineConfig, GiB
from engine.host_memory import host_memory
from models.interfaces import LanguageModel
from models.layers.delta_rule_choice import choose_delta_rule

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheLayout:
    """KV-cache geometry derived at start-up from the options, the model and the device."""

    num_blocks: int
    block_size: int
    max_model_len: int
    bytes_per_block: int
    # The context the model serves when `max_model_len` was lowered from it to fit the KV
    # budget (no max_model_len given); None when the budget holds the full context.
    fitted_from: int | None = None

    @property
    def fit_note(self) -> str:
        """What the start-up line and the panel say of a context lowered to fit ("" if not)."""
        if self.fitted_from is None:
            return ""
        return (f"context {self.max_model_len} of the model's {self.fitted_from} tokens: the "
                f"longest the KV budget holds ({self.num_blocks} blocks); set kv_cache_bytes "
                "for more, or max_model_len to choose")

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


@dataclass(frozen=True)
class StateLayout:
    """Recurrent-state pools of a hybrid model's linear-attention layers, sized at start-up:
    one slot per running request (`max_num_seqs`) and `num_snapshots` prefix snapshots."""

    num_slots: int
    num_snapshots: int
    bytes_per_sequence: int  # all linear layers' state of one sequence (= of one snapshot)
    num_layers: int

    @property
    def slot_bytes(self) -> int:
        return self.num_slots * self.bytes_per_sequence

    @property
    def snapshot_bytes(self) -> int:
        return self.num_snapshots * self.bytes_per_sequence


# ---- the context ----------------------------------------------------------------------------


def context_length(hf_config) -> tuple[int, str]:
    """The longest sequence the model serves, and what sets it: max_position_embeddings, or for
    longrope its original_max_position_embeddings (its long factors are not implemented)."""
    text_cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    model_max = getattr(text_cfg, "max_position_embeddings", None) or 2048
    if getattr(text_cfg, "max_target_positions", None):  # an encoder-decoder's decoder (Whisper)
        return text_cfg.max_target_positions, (
            f"max_target_positions={text_cfg.max_target_positions}")
    rope = getattr(text_cfg, "rope_parameters", None) or {}
    if rope.get("rope_type") == "longrope":
        model_max = min(model_max, rope["original_max_position_embeddings"])
        return model_max, (f"longrope's original_max_position_embeddings={model_max}; longer "
                           "sequences would need its long factors, which are not implemented")
    return model_max, f"max_position_embeddings={model_max}"


def requested_max_model_len(hf_config, config: EngineConfig) -> int:
    """`max_model_len` as configured (the model's context length when unset); a value past the
    model's context length is refused."""
    model_max, limit = context_length(hf_config)
    if config.max_model_len is None:
        return model_max
    if config.max_model_len > model_max:
        raise ValueError(
            f"max_model_len={config.max_model_len} exceeds the model's context length "
            f"({limit})"
        )
    return config.max_model_len


# ---- the KV cache ---------------------------------------------------------------------------


def default_kv_bytes(device: torch.device) -> int:
    """The automatic KV budget (EngineConfig.kv_cache_bytes): on CUDA 85% of the free memory,
    on the CPU a quarter of what the host can still give (engine/host_memory.py: MemAvailable,
    or a cgroup limit's room), at most 4 GiB."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.85)
    return min(4 * GiB, host_memory().available // 4)


def kv_bytes_per_block(model: LanguageModel, block_size: int, dtype: torch.dtype,
                       kv_cache_dtype: str = "auto") -> int:
    """Keys and values of one block in every layer that holds a cache (layers reading another
    layer's keys and values hold none), in the element type of `kv_cache_dtype`."""
    return block_size * kv_pool.bytes_per_token(model.attention_layers(), dtype, kv_cache_dtype)


def plan_kv_cache(model: LanguageModel, config: EngineConfig, dtype: torch.dtype,
                  device: torch.device, max_model_len: int, reserved: int = 0) -> CacheLayout:
    """The KV cache's blocks within the budget. `reserved`: bytes the automatic budget leaves
    to other states (cross-attention keys and values).

    A budget that holds fewer than `max_model_len` tokens lowers the context to what it holds
    (whole blocks) when no max_model_len was configured, and is refused when one was."""
    bs = config.block_size
    per_block = kv_bytes_per_block(model, bs, dtype, config.kv_cache_dtype)
    useful = config.max_num_seqs * -(-max_model_len // bs) * per_block
    budget = config.kv_cache_bytes
    if budget is None:
        budget = min(default_kv_bytes(device) - reserved, useful)
    num_blocks = max(budget, 0) // per_block
    held = num_blocks * bs
    if held < max_model_len and config.max_model_len is None and held >= 2:
        layout = CacheLayout(num_blocks, bs, held, per_block, fitted_from=max_model_len)
        log.warning("%s", layout.fit_note)
        return layout
    if held < max_model_len:
        raise ValueError(
            f"the KV cache holds {held} tokens ({budget} bytes at "
            f"{per_block} bytes per {bs}-token block), fewer than max_model_len="
            f"{max_model_len}; raise kv_cache_bytes to at least "
            f"{-(-max_model_len // bs) * per_block} or lower max_model_len"
        )
    return CacheLayout(num_blocks, bs, max_model_len, per_block)


def state_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A recurrent-state pool (slots, snapshots or their backups), reserved, not written: a slot
    is zeroed when a sequence starts in it and a snapshot written before it is restored
    (models/layers/gated_deltanet.py), and every read is of such a slot."""
    return torch.empty(shape, dtype=dtype, device=device)


def allocate_kv_cache(model: LanguageModel, layout: CacheLayout, dtype: torch.dtype,
                      kv_cache_dtype: str, device: torch.device) -> list[torch.Tensor]:
    """The KV pools bound to the attention layers (engine/kv_pool.py: reserved, not written;
    unwritten slots kept out of attention by masking: engine/kv_blocks_in_use.py). Returns the
    caches."""
    return kv_pool.allocate(model.attention_layers(), layout.num_blocks, layout.block_size,
                            dtype, kv_cache_dtype, device)


# ---- recurrent states -----------------------------------------------------------------------


def allocate_states(model: LanguageModel, config: EngineConfig, dtype: torch.dtype,
                    device: torch.device) -> StateLayout | None:
    """The linear-attention layers' state pools (None for a model without such layers):
    a slot per running request and the prefix snapshots within `state_snapshot_bytes`."""
    layers = model.state_layers()
    if not layers:
        return None
    shape = layers[0].shape
    per_sequence = len(layers) * shape.state_bytes(dtype)
    budget = config.state_snapshot_bytes
    if budget is None:
        budget = min(64 * per_sequence, GiB)
    snapshots = budget // per_sequence if config.enable_prefix_caching else 0
    slots = config.max_num_seqs
    conv, recurrent = shape.state_shapes()
    recurrence = choose_delta_rule(*recurrent, device)
    for layer in layers:
        layer.recurrence = recurrence
        layer.bind_state(
            state_pool((slots, *conv), dtype, device),
            state_pool((slots, *recurrent), torch.float32, device),
            state_pool((snapshots, *conv), dtype, device),
            state_pool((snapshots, *recurrent), torch.float32, device))
    return StateLayout(slots, snapshots, per_sequence, len(layers))


def bind_verify_backups(model: LanguageModel) -> None:
    """Speculative decoding on a hybrid model: a backup of each linear layer's slot pools,
    where verifications keep their slots' states before the step (as large as the slots:
    `StateLayout.slot_bytes` more)."""
    for layer in model.state_layers():
        conv, recurrent = layer.conv_states, layer.recurrent_states
        layer.bind_backups(state_pool(conv.shape, conv.dtype, conv.device),
                           state_pool(recurrent.shape, recurrent.dtype, recurrent.device))
