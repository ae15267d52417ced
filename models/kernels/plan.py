"""Start-up plan of every CPU linear's formulation per row-count bucket, by measurement.

Linears are grouped by weight format, dtype and shape (a decoder has a handful of groups); each
group's bucket gets the fastest candidate of models.kernels.linear, timed once on this machine
and cached on disk (models.kernels.choice), F.linear unless another wins by a margin. A group is
timed on its own layers in turn, as a decode step streams them from memory, up to a byte and a
FLOP budget per call; a group of one huge matrix (the LM head), or a layer too large for the
FLOP budget at a prefill's row count, is timed on its first output channels. PyTorch's int4
kernel, which keeps a second pack of the weight, is a candidate only for groups whose packs
fit `TORCH_INT4_PACK_SHARE` of the model's int4 bytes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from torch import nn

from models.kernels import native
from models.kernels.choice import (
    BASELINE,
    BUCKETS,
    MARGIN,
    PROBE_ROWS,
    KernelCache,
    Timer,
    cache_path,
    choose,
    measure,
)
from models.kernels.linear import (
    KERNELS,
    QUANTIZED_KERNELS,
    Linear,
    dequantization_tiles,
)
from models.kernels.quantization import INT4_BLOCK_N, QuantizedLinear

log = logging.getLogger(__name__)

TIMED_BYTES = 32 << 20  # weight bytes one timed call streams through, at most (more than L2)
TIMED_FLOPS = 5e8  # and FLOPs
SLICE_ROWS = 16384  # a lone matrix with more output rows is timed on its first rows
PLAN_SECONDS = 3.0  # past this, buckets left unmeasured keep F.linear (and are not cached)
NATIVE_ROWS = PROBE_ROWS[1]  # our matrix-vector kernel is a candidate up to this many rows
QUANTIZED_NATIVE_ROWS = PROBE_ROWS[2]  # and for a quantized weight up to this many
# At a decode's rows, how much faster than ours another kernel must be to be chosen: one layer
# group planned to PyTorch's costs every decode step the one native call through all layers
# (models.kernels.native_decode), whose saving no single linear's timing shows (a group 9%
# faster through PyTorch's int4 kernel, within timing noise, made a whole step 1.6x slower).
DECODE_MARGIN = 0.25
# PyTorch's int4 kernel reads a pack of its own, a second copy of the weight beside ours: the
# groups planned to it may add at most this share of the model's int4 bytes (the largest groups,
# a mixture's experts or a large model's layers, keep one copy).
TORCH_INT4_PACK_SHARE = 0.1
# The version of the candidates and choosing rules below, part of the cache file's name: bump
# it when they change, so that choices made under the old ones are timed afresh.
PLAN_RULES = 5


def candidates(layer: nn.Module, rows: int, dtype: torch.dtype,
               torch_int4: bool = True) -> list[str]:
    """The formulations worth timing for this layer at `rows` rows, the baseline first (what
    runs when nothing beats it, or when the plan's time budget is spent). `torch_int4=False`:
    PyTorch's int4 kernel is not one (its pack of the weight would not fit the budget)."""
    # Ours streams each weight row once and reuses it per input row: a decode's few rows, and
    # for a quantized weight up to QUANTIZED_NATIVE_ROWS (its rows come from cache again
    # cheaper than a dequantized GEMM or PyTorch's int kernels run at those counts).
    limit = QUANTIZED_NATIVE_ROWS if layer.is_quantized else NATIVE_ROWS
    ours = rows <= limit and native.load() is not None
    if layer.is_quantized:
        names = ["int_kernel"] if layer.mode == "int8" or torch_int4 else []
        if ours:
            names.append("native")
        # Dequantizing per call pays only when rows share the weight (the int kernels' dot
        # products grow with the rows: at a few rows already they can lose), and at a decode's
        # rows only through ours, tile by tile into a reused buffer: PyTorch's whole copy of a
        # large weight (an LM head) would take fresh pages every step, which timing a slice of
        # it does not see. x W^T is timed only for a weight of one tile: over several, each
        # tile's product is copied into a column slice of the output, which the one-tile slice
        # that timing a large layer sees would hide. A float32 model's GEMMs are timed in
        # bfloat16 too, as the int kernels compute.
        tiled = native.load() is not None
        if rows > 1 and (tiled or rows > PROBE_ROWS[2]):
            for gemm_dtype, suffix in [(dtype, "")] + (
                    [(torch.bfloat16, "_bf16")] if dtype == torch.float32 else []):
                if len(dequantization_tiles(layer.out_features, layer.in_features,
                                            gemm_dtype)) == 1:
                    names.append("dequantized" + suffix)
                names.append("dequantized_t" + suffix)
        if rows > NATIVE_ROWS and panel_gemm_takes(layer):
            names.append("panel_gemm")
        return names or ["dequantized_t"]  # the weight dequantized per call, where nothing else
    names = [BASELINE]
    if dtype in (torch.float32, torch.bfloat16):
        names.append("mv" if rows == 1 else "matmul_t")
        if onednn_prepacks(dtype):
            names.append("onednn")
        if ours:
            names.append("native")
        if dtype == torch.bfloat16 and rows > 1:
            names.append("widened")
    return names


def panel_gemm_takes(layer: QuantizedLinear) -> bool:
    """Whether our panel-dequantizing GEMM (models/kernels/cpu/gemm_quantized.c) takes this
    layer."""
    kernels = native.load()
    if kernels is None:
        return False
    if layer.mode == "int8":
        return kernels.gemm_quantized_takes(layer.out_features, layer.in_features)
    return kernels.gemm_quantized_takes(layer.out_features, layer.in_features,
                                        layer.group_size)


def onednn_prepacks(dtype: torch.dtype) -> bool:
    """Whether oneDNN can prepack a weight of `dtype` on this CPU (bfloat16 needs AVX-512 BW /
    VL / DQ or AVX-NE-CONVERT: oneDNN refuses it elsewhere)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (
        dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def group_key(layer: nn.Module, dtype: torch.dtype) -> str:
    return (f"{layer.format}/{str(dtype).removeprefix('torch.')}/"
            f"{layer.out_features}x{layer.in_features}")


def linear_groups(model: nn.Module, dtype: torch.dtype) -> dict[str, list[nn.Module]]:
    groups: dict[str, list[nn.Module]] = {}
    for module in model.modules():
        if isinstance(module, (Linear, QuantizedLinear)):
            groups.setdefault(group_key(module, dtype), []).append(module)
    return groups


def plan_linears(model: nn.Module, dtype: torch.dtype, cache: KernelCache | None = None,
                 timer: Timer = measure, budget_s: float = PLAN_SECONDS) -> dict[str, tuple]:
    """Set every CPU linear's `kernels` (one formulation per bucket): cached choices are
    reused, new ones timed and saved. Returns {group key: choices per bucket}."""
    built = native.load()  # built (once) before the clock starts: it is not the plan's time
    if cache is None:
        cache = KernelCache(cache_path(native_build=built.build_id if built else None,
                                       rules=PLAN_RULES))
    # The largest groups first: if the budget runs out, it is spent where the bytes are.
    groups = dict(sorted(linear_groups(model, dtype).items(),
                         key=lambda item: -sum(_nbytes(layer) for layer in item[1])))
    start = time.perf_counter()
    plans: dict[str, tuple] = {}
    int4 = [layer for group in groups.values() for layer in group
            if layer.is_quantized and layer.mode == "int4"]
    pack_budget = TORCH_INT4_PACK_SHARE * sum(layer.qweight.nbytes for layer in int4)
    with torch.inference_mode():
        for key, group in groups.items():
            # the bytes PyTorch's int4 pack of this group would add (0 for other formats)
            pack = sum(layer.qweight.nbytes for layer in group
                       if layer.is_quantized and layer.mode == "int4")
            torch_int4 = pack <= pack_budget
            plan = []
            for bucket, rows in zip(BUCKETS, PROBE_ROWS, strict=True):
                names = candidates(group[0], rows, dtype, torch_int4)
                bucket_key = f"{key}/{bucket}"
                if cache.get(bucket_key, set(names)) is None and (
                        time.perf_counter() - start > budget_s):
                    plan.append(names[0])
                    continue
                plan.append(_choose(bucket_key, rows, names, group, dtype, cache, timer))
            plans[key] = tuple(plan)
            if "int_kernel" in plan:
                pack_budget -= pack
            for layer in group:
                if "onednn" in plan:
                    _prepack(layer)
                elif not layer.is_quantized:
                    layer.packed = None  # prepacked only for timing
                elif "int_kernel" not in plan:
                    layer.torch_packed = None  # PyTorch's int4 pack: made only for timing
                layer.kernels = plans[key]
    cache.save()
    log.info("linear kernels for %d groups planned in %.2f s", len(groups),
             time.perf_counter() - start)
    return plans


def _choose(key: str, rows: int, names: list[str], group: list[nn.Module],
            dtype: torch.dtype, cache: KernelCache, timer: Timer) -> str:
    """One bucket's choice for a group: cached, or timed on the group's layers. Where ours is
    a candidate (a decode's rows) it is kept unless another is faster by DECODE_MARGIN: a
    decoder whose linears all run ours takes its decode steps in one native call
    (models.kernels.native_decode), which saves more than one linear's timing shows. Our
    quantized GEMM is kept on a tie (MARGIN) at a prefill's rows: its result is contiguous,
    where the dequantized `_t` formulations' is a transposed view whose cost falls on the
    operations after the linear, which timing it alone does not see (bench.prefill_ab at 512
    tokens: bfloat16 int8 TTFT 0.99x dense through ours, 1.22x through `dequantized_t`, the
    linears alone tying)."""
    margin = MARGIN
    for ours in ("native", "panel_gemm"):
        if ours in names:
            names = [ours] + [n for n in names if n != ours]
            margin = DECODE_MARGIN if ours == "native" else MARGIN
            break
    if cache.get(key, set(names)) is not None or len(names) == 1:
        return choose(key, {n: _noop for n in names}, cache, timer)
    layers = _timing_layers(group, rows, dtype)
    x = torch.randn(rows, group[0].in_features, dtype=dtype)
    if "onednn" in names:
        try:
            for layer in layers:
                _prepack(layer)
        except RuntimeError:
            names = [n for n in names if n != "onednn"]
    table = QUANTIZED_KERNELS if group[0].is_quantized else KERNELS

    def run(name: str) -> Callable[[], object]:
        kernel = table[name]
        return lambda: [kernel(layer, x) for layer in layers]

    return choose(key, {n: run(n) for n in names}, cache, timer, margin)


def _timing_layers(group: list[nn.Module], rows: int, dtype: torch.dtype) -> list[nn.Module]:
    """The layers one timed call runs through: as many of the group as the budgets allow, or
    the first output channels of one layer (every candidate's cost grows with the channels
    alike, so a slice ranks them as the whole does) when a lone matrix is huge or one layer
    alone exceeds the FLOP budget at this row count."""
    first = group[0]
    per_channel = 2.0 * rows * first.in_features
    fit = int(TIMED_FLOPS // per_channel) // INT4_BLOCK_N * INT4_BLOCK_N
    cap = SLICE_ROWS if len(group) == 1 else first.out_features
    channels = min(first.out_features, cap, max(INT4_BLOCK_N, fit))
    if channels < first.out_features:
        return [_first_channels(first, channels)]
    n = min(len(group), int(TIMED_BYTES // max(_nbytes(first), 1)),
            int(TIMED_FLOPS // (per_channel * first.out_features)))
    return group[:max(1, n)]


def _first_channels(layer: nn.Module, n: int) -> nn.Module:
    if layer.is_quantized:
        return layer.first_rows(n)
    sliced = Linear(layer.in_features, n, bias=False, device="meta")
    sliced.weight = nn.Parameter(layer.weight.detach()[:n], requires_grad=False)
    return sliced


def _nbytes(layer: nn.Module) -> int:
    weights = [layer.qweight, layer.scales] if layer.is_quantized else [layer.weight]
    return sum(w.numel() * w.element_size() for w in weights)


def _prepack(layer: nn.Module) -> None:
    if layer.packed is None:
        layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), 1)


def _noop() -> None:
    return None
