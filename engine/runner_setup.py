"""The model runner's start-up (RunnerSetup, ModelRunner's base): the weights loaded
(engine/model_loading.py), the decode attention kernel chosen, the cross-attention states, the
KV cache and the state pools planned and reserved (engine/memory_plan.py), the decode steps'
one native call prepared; and what changes them after start-up (a draft model's KV cache
resized to its target's blocks, the decode kernels pinned for speculative decoding).
ModelRunner (engine/model_runner.py) runs the steps on what this sets up."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.cross_states import plan_cross_states
from engine.kv_blocks_in_use import BlocksInUse
from engine.load_progress import StartupProgress
from engine.memory_plan import (
    allocate_kv_cache,
    allocate_states,
    bind_verify_backups,
    default_kv_bytes,
    plan_kv_cache,
    requested_max_model_len,
)
from engine.model_loading import load_model
from models.interfaces import LanguageModel
from models.kernels import native
from models.kernels.linear_choice import pin_decode_rows
from models.kernels.row_invariance import pad_device_rows
from models.layers.attention_varlen import choose_backend
from models.layers.decode_attention_choice import choose_decode_attention

log = logging.getLogger(__name__)


class RunnerSetup:
    """The model and the caches a ModelRunner steps on: `model`, `layout` and `kv_caches` (the
    paged KV cache), `state_layout` (a hybrid model's state pools), `cross_layout` (cross-attention
    keys and values), `encoder_outputs`, the attention kernels chosen, `native_decode`."""

    def __init__(
        self,
        path: Path,
        hf_config,
        model_cls: type[LanguageModel],
        config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        mmproj: Path | None = None,  # a GGUF model's projector file (its tower)
        progress: StartupProgress | None = None,  # told of each start-up stage
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        progress = progress or StartupProgress()
        max_len = requested_max_model_len(hf_config, config)
        loaded = load_model(path, hf_config, model_cls, config, device, dtype, max_len, mmproj,
                            progress)
        self.model = loaded.model
        self.gguf_summary = loaded.gguf_summary  # for a GGUF file: which tensors run as stored
        # LoRA adapters requests may choose: the checkpoint's, per modality, and the configured.
        self.adapters, self._media_adapters = loaded.adapters, loaded.modality_adapters
        self.vocab_size = self.model.cfg.vocab_size
        self.windows = self.model.attention_windows()
        self.span_windows = _span_windows(self.model.attention_layers())
        cfg = self.model.cfg
        kv_heads, head_dim = _common_kv_shape(self.model.attention_layers())
        with progress.step("choosing the decode attention kernel"):
            self.decode_kernel = choose_decode_attention(
                cfg.num_heads, kv_heads, head_dim, dtype, device, config.block_size,
                config.kv_cache_dtype,
            )
        self.attention_backend = choose_backend(device, dtype)
        # Cross-attention layers' keys and values (engine/cross_states.py), out of the KV budget.
        self.cross_layout = plan_cross_states(self.model, config, dtype, default_kv_bytes(device))
        self.layout = plan_kv_cache(
            self.model, config, dtype, device, max_len,
            0 if self.cross_layout is None else self.cross_layout.nbytes)
        pools = "reserving the KV cache and state pools"
        progress(pools, 0, 2)
        self._allocate_kv_cache()
        progress(pools, 1, 2)
        self.state_layout = allocate_states(self.model, config, dtype, device)
        progress(pools, 2, 2)
        # Whether decode steps run the layers in one native call (CPU; at some row counts).
        with progress.step("preparing the decode step"):
            self.native_decode = device.type == "cpu" and self.model.prepare_decode()
        # Encoder outputs by content hash; which ones exist is decided by EncoderCacheManager.
        self.encoder_outputs: dict[str, torch.Tensor] = {}

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Re-allocate the KV cache with `num_blocks` blocks (a draft model's, indexed by its
        target's block ids: engine/speculative/draft_model.py)."""
        self.layout = replace(self.layout, num_blocks=num_blocks)
        self._allocate_kv_cache()
        if self.native_decode:
            self.prepare_native_decode()  # it holds the caches' pointers

    def _allocate_kv_cache(self) -> None:
        """The KV pools of `self.layout`, reserved, not written (engine/kv_blocks_in_use.py)."""
        self.kv_caches = allocate_kv_cache(self.model, self.layout, self.dtype,
                                           self.config.kv_cache_dtype, self.device)
        self.kv_blocks_in_use = BlocksInUse(self.layout.num_blocks)

    def prepare_native_decode(self) -> None:
        """Set up the decode steps' one native call again (models/layers/native_decode.py),
        after the caches or the linears' decode kernels changed; `native_decode` says whether
        decode steps take it."""
        self.native_decode = self.model.prepare_decode()

    def pin_decode_kernels(self) -> None:
        """The decode rows' kernels made to compute each row by itself (a verification's rows
        then sum as decodes of their tokens do, whatever shares the step: speculative
        decoding). On the CPU, pinned to ours: the linears' decode buckets
        (models.kernels.linear_choice.pin_decode_rows) and the paged decode attention, where
        the library builds (PyTorch's decode attention batches decodes with padding, rounding
        a row differently by what shares its bucket). Elsewhere, the inputs of up to a decode
        bucket's rows padded to one shape in the linears measured to need it
        (models.kernels.row_invariance), and in the LoRA adapters' products
        (models/layers/lora.py); the norms (fused) and attention there compute a row alike at
        any row count (tests/test_cuda_features.py)."""
        if self.device.type != "cpu":
            pad_device_rows(self.model, self.dtype)
            if self.adapters is not None:  # their small products, unmeasured: padding is cheap
                self.adapters.pad_rows = native.FUSED_ROWS
            return
        if pin_decode_rows(self.model, self.dtype):
            self.prepare_native_decode()  # it serves the pinned buckets
        if self.decode_kernel != "native" and native.load() is not None and (
                self.dtype in native.DTYPES):
            log.info("speculative decoding: decode attention pinned to our paged kernel "
                     "(measured %s faster here)", self.decode_kernel)
            self.decode_kernel = "native"
            self.prepare_native_decode()

    def bind_verify_backups(self) -> None:
        """Speculative decoding on a hybrid model: a backup of each linear layer's slot pools,
        where verifications keep their slots' states before the step (as large as the slots:
        `StateLayout.slot_bytes` more)."""
        bind_verify_backups(self.model)


def _span_windows(layers) -> tuple[int | None, ...]:
    """The windows whose layers attend bidirectional spans both ways (metadata is per window,
    so the layers sharing one must agree)."""
    kinds: dict[int | None, set[bool]] = {}
    for a in layers:
        kinds.setdefault(a.layout.sliding_window, set()).add(a.layout.bidirectional)
    mixed = [w for w, k in kinds.items() if len(k) > 1]
    if mixed:
        raise NotImplementedError(f"layers with window {mixed[0]} differ in whether they "
                                  "attend media spans both ways")
    return tuple(w for w, k in kinds.items() if True in k)


def _common_kv_shape(layers) -> tuple[int, int]:
    """The (KV heads, head size) most attention layers have (the decode kernel is timed at it;
    every kernel serves every shape)."""
    shapes = [(a.num_kv_heads, a.head_dim) for a in layers]
    return max(dict.fromkeys(shapes), key=shapes.count)
