"""What the engine says about itself, read off its model runner: the memory its caches hold (KV
blocks, recurrent states, cross-attention keys and values, a per-layer embedding table), the
start-up line, and the weights' precision and kernels. The panels and the API show these."""

from __future__ import annotations

from typing import Any

import torch

from engine import kv_pool
from engine.device import cpu_has_native_bf16
from engine.host_memory import resident_bytes
from engine.model_runner import ModelRunner
from engine.state_cache import StateCacheManager
from models.kernels import native


def kv_stats(runner: ModelRunner) -> dict[str, Any]:
    """The KV cache's bytes per block and the layers that hold it (a layer reading another
    layer's keys and values holds none); for a quantized cache (`kv_cache_dtype`), its element
    type and how many times the tokens of a model-dtype cache its bytes hold; the bytes of a
    per-layer embedding table (weights a step reads a few rows of), where the model has one;
    the context's fit to the KV budget where no max_model_len was given and the model's context
    did not fit; and the pools' reserved and resident bytes (resident: the pages touched, by
    mincore on a Linux CPU, else the blocks used so far)."""
    layers = runner.attention_layers()
    shared = sum(a.kv_source is not None for a in layers)
    out: dict[str, Any] = {
        "kv_bytes_per_block": runner.layout.bytes_per_block,
        "kv_layers": f"{len(layers) - shared} of {len(layers)} layers"
        + (f" ({shared} read another layer's)" if shared else "")}
    kv_dtype = runner.config.kv_cache_dtype
    if kv_dtype != "auto":  # the tokens the same bytes hold, against the model dtype's cache
        out["kv_cache_dtype"] = kv_dtype
        out["kv_capacity_gain"] = round(kv_pool.capacity_gain(layers, runner.dtype, kv_dtype), 2)
        out["kv_model_dtype"] = str(runner.dtype).removeprefix("torch.")
    table = runner.per_layer_table_bytes()
    if table:
        out["per_layer_table_bytes"] = table
    if runner.layout.fitted_from is not None:
        out["context_fit"] = runner.layout.fit_note
    out["kv_blocks_first_used"] = runner.kv_blocks_in_use.count
    out["kv_reserved_bytes"] = runner.layout.num_blocks * runner.layout.bytes_per_block
    resident = resident_bytes(runner.kv_caches)
    out["kv_resident_bytes"] = (runner.kv_blocks_in_use.count * runner.layout.bytes_per_block
                                if resident is None else resident)
    return out


def kv_capacity_note(stats: dict[str, Any]) -> str:
    """"int8 keys and values: 1.88x the tokens of bfloat16" for a quantized cache (kv_stats),
    else ""."""
    if "kv_cache_dtype" not in stats:
        return ""
    return (f"{stats['kv_cache_dtype']} keys and values: {stats['kv_capacity_gain']:.2f}x the "
            f"tokens of {stats['kv_model_dtype']}")


def state_stats(runner: ModelRunner, state_cache: StateCacheManager | None) -> dict[str, Any]:
    """The linear-attention state cache (hybrid models; empty for the others): slots and
    snapshots in use, their bytes (and the resident part, on a Linux CPU), and how many prefix
    hits restored a snapshot."""
    states = runner.state_layout
    if states is None or state_cache is None:
        return {}
    pools = [t for layer in runner.state_layers()
             for t in (layer.conv_states, layer.recurrent_states, layer.conv_snapshots,
                       layer.recurrent_snapshots, layer.conv_backups, layer.recurrent_backups)]
    resident = resident_bytes(pools)
    return {**state_cache.snapshot_stats(),
            "state_bytes_per_request": states.bytes_per_sequence,
            "state_slot_bytes": states.slot_bytes,
            "state_snapshot_bytes": states.snapshot_bytes,
            **({} if resident is None else {"state_resident_bytes": resident})}


def cross_stats(runner: ModelRunner) -> dict[str, int]:
    """A cross-attention model's keys-and-values budget (the encoder cache's entries, in key
    positions, are those states; empty for other models)."""
    cross = runner.cross_layout
    if cross is None:
        return {}
    return {"cross_attention_layers": cross.num_layers,
            "cross_attention_bytes_per_key": cross.bytes_per_key,
            "cross_attention_cache_bytes": cross.nbytes}


def weights_description(runner: ModelRunner) -> str:
    """The weights' precision and device, e.g. "bfloat16, 169 int4 (group 128) linears, cpu,
    own kernels (avx512-bf16), decode in one native call" (which linears are quantized, at
    which format; for a GGUF file, which of its tensors run as stored; on the CPU: the variant
    of models.kernels.native built, else PyTorch's kernels only; whether bfloat16 is widened to
    float32 for lack of bfloat16 arithmetic; whether decode steps run
    models.layers.native_decode's call)."""
    text = str(runner.dtype).removeprefix("torch.")
    for fmt, count in runner.quantized_formats().items():
        mode, _, group = fmt.partition("g")
        kind = f"{mode} (group {group})" if group else f"{mode} (per channel)"
        text += f", {count} {kind} linears"
    if runner.gguf_summary:
        text += f", from GGUF ({runner.gguf_summary})"
    if runner.device.type != "cpu":
        return f"{text}, {runner.device}"
    kernels = native.load()
    text += f", cpu, own kernels ({kernels.variant})" if kernels else ", cpu, PyTorch kernels"
    if runner.dtype == torch.bfloat16 and not cpu_has_native_bf16():
        text += ", bfloat16 kept in memory, multiplied in float32 (no bfloat16 arithmetic)"
    return text + (", decode in one native call" if runner.native_decode else "")


def ready_line(model_id: str, runner: ModelRunner) -> str:
    """The one line logged when the engine is ready: the model, its weights, the caches."""
    layout, mib = runner.layout, 1 << 20
    kv = kv_stats(runner)
    quantized = kv_capacity_note(kv)
    line = (f"engine ready: {model_id} ({weights_description(runner)}), {layout.num_blocks} KV "
            f"blocks x {layout.block_size} tokens ({kv['kv_layers']}"
            f"{'; ' + quantized if quantized else ''}), max_model_len {layout.max_model_len}"
            + (f" (fitted to the KV budget; the model's context is {layout.fitted_from})"
               if layout.fitted_from is not None else ""))
    states = runner.state_layout
    if states is not None:
        line += (f"; recurrent state of {states.num_layers} linear-attention layers: "
                 f"{states.bytes_per_sequence / mib:.1f} MiB per request, {states.num_slots} "
                 f"slots ({states.slot_bytes / mib:.0f} MiB) and {states.num_snapshots} prefix "
                 f"snapshots ({states.snapshot_bytes / mib:.0f} MiB)")
    cross = runner.cross_layout
    if cross is not None:
        line += (f"; keys and values of {cross.num_layers} cross-attention layers: "
                 f"{cross.bytes_per_key / 1024:.1f} KiB per media key position, "
                 f"{cross.nbytes / mib:.0f} MiB for {cross.num_keys} positions")
    if "per_layer_table_bytes" in kv:
        line += (f"; per-layer embedding table {kv['per_layer_table_bytes'] / 2**30:.2f} GiB, "
                 "read a few rows per step")
    return line
