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

import functools
import logging
import os
import time
from collections import Counter
from collections.abc import Callable

import torch
from torch import nn

from models.kernels import native
from models.kernels.choice import (
    BASELINE,
    BUCKETS,
    MARGIN,
    PROBE_ROWS,
    Choice,
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
TIMED_FLOPS = 1e9  # and FLOPs
SLICE_ROWS = 16384  # a lone matrix with more output rows is timed on its first rows
# Past this, buckets left unmeasured take the timed groups' choice, unsaved (timed at the next
# start); $MMSERVE_PLAN_SECONDS sets another (a first start that plans a large model whole).
PLAN_SECONDS = 8.0
PLAN_SECONDS_ENV = "MMSERVE_PLAN_SECONDS"
# Our matrix-vector kernel is a candidate up to this many rows: it streams each weight row once
# and reuses it from cache for every row of the input, where a GEMM (a bfloat16 one on a CPU
# without bfloat16 arithmetic above all, which widens the whole weight first) or a dequantized
# GEMM reads or writes the weight several times: short prefill chunks (a second turn's new
# text) and many concurrent decodes.
NATIVE_ROWS = PROBE_ROWS[2]
DECODE_ROWS = PROBE_ROWS[1]  # a decode step of a few requests; more rows may be a prefill
# Our register-tiled kernel (models/kernels/cpu/linear_rows.c) is a candidate past a decode's rows
# up to this many: a short prefill chunk, many requests' decodes; longer prefills are a GEMM's.
TILED_ROWS = PROBE_ROWS[3]
# Our packed-panel GEMM (models/kernels/cpu/gemm_dense.c) is a candidate past a decode's rows: a
# prefill's, a vision tower's, and a short chunk's (a second turn's new text), where it packs each
# strip of the weight just before its tiles read it and may beat the register-tiled kernel.
GEMM_ROWS = DECODE_ROWS
# A quantized weight's dequantized GEMM is timed in the other of float32 and bfloat16 too.
OTHER_GEMM_DTYPE = {torch.float32: [(torch.bfloat16, "_bf16")],
                    torch.bfloat16: [(torch.float32, "_f32")]}
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
PLAN_RULES = 9


def candidates(layer: nn.Module, rows: int, dtype: torch.dtype,
               torch_int4: bool = True) -> list[str]:
    """The formulations worth timing for this layer at `rows` rows, the baseline first (what
    runs when nothing beats it, or when the plan's time budget is spent). `torch_int4=False`:
    PyTorch's int4 kernel is not one (its pack of the weight would not fit the budget)."""
    ours = rows <= NATIVE_ROWS and native.load() is not None
    if layer.is_quantized:
        # PyTorch's int kernels: int8 with a scale per channel, int4 (if its pack fits)
        torch_kernel = layer.has_torch_kernel and (layer.mode == "int8" or torch_int4)
        names = ["int_kernel"] if torch_kernel else []
        # int4: our integer kernel's tiles of weight stay in cache across rows, and it is a
        # candidate as far as the tiled dense kernel (at 128 rows it measured ahead of the
        # dequantizing GEMMs on Qwen2.5-VL-3B's shapes on an AVX2 CPU)
        if ours or (layer.mode == "int4" and tiled_rows(rows)):
            names.append("native")
        if layer.mode == "int8" and tiled_rows(rows):
            names.append("native_rows")
        if gemm_rows(rows):  # an int4 layer's shape and group (32-128) it always takes
            names.append("native_gemm")
        # Dequantizing per call pays only when rows share the weight (the int kernels' dot
        # products grow with the rows: at a few rows already they can lose), and at a decode's
        # rows only through ours, tile by tile into a reused buffer: PyTorch's whole copy of a
        # large weight (an LM head) would take fresh pages every step, which timing a slice of
        # it does not see. x W^T is timed only for a weight of one tile: over several, each
        # tile's product is copied into a column slice of the output, which the one-tile slice
        # that timing a large layer sees would hide. The GEMMs are timed in the other of
        # float32 and bfloat16 too: a float32 model's in bfloat16 (as the int kernels
        # compute), a bfloat16 model's in float32 (CPUs without bfloat16 arithmetic).
        tiled = native.load() is not None
        if rows > 1 and (tiled or rows > PROBE_ROWS[2]):
            for gemm_dtype, suffix in [(dtype, "")] + OTHER_GEMM_DTYPE.get(dtype, []):
                if len(dequantization_tiles(layer.out_features, layer.in_features,
                                            gemm_dtype)) == 1:
                    names.append("dequantized" + suffix)
                names.append("dequantized_t" + suffix)
        if rows > DECODE_ROWS and panel_gemm_takes(layer):
            names.append("panel_gemm")
        return names or ["dequantized_t"]  # the weight dequantized per call, where nothing else
    names = [BASELINE]
    if dtype in (torch.float32, torch.bfloat16):
        if rows == 1 or not layer.contiguous_output:
            names.append("mv" if rows == 1 else "matmul_t")
        if onednn_prepacks(dtype):
            names.append("onednn")
        if ours:
            names.append("native")
        if tiled_rows(rows):
            names.append("native_rows")
        if gemm_rows(rows):
            names.append("native_gemm")
        if dtype == torch.bfloat16 and rows > 1:
            names.append("widened")
    return names


def tiled_rows(rows: int) -> bool:
    """Whether our register-tiled kernel is a candidate at `rows` rows."""
    return DECODE_ROWS < rows <= TILED_ROWS and native.load() is not None


def gemm_rows(rows: int) -> bool:
    """Whether our packed-panel GEMM is a candidate at `rows` rows."""
    return rows > GEMM_ROWS and native.load() is not None


def panel_gemm_takes(layer: QuantizedLinear) -> bool:
    """Whether our panel-dequantizing GEMM (models/kernels/cpu/gemm_quantized.c) takes this
    layer."""
    kernels = native.load()
    if kernels is None:
        return False
    if layer.mode == "int8":
        return kernels.gemm_quantized_takes(layer.out_features, layer.in_features,
                                            int8_group=layer.group_size)
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
                 timer: Timer = measure, budget_s: float | None = None,
                 ruler: Callable[[], float] | None = None) -> dict[str, tuple]:
    """Set every CPU linear's `kernels` (one formulation per bucket): cached choices are
    reused, new ones timed and saved. Returns {group key: choices per bucket}.

    A saved plan is first re-checked on one group (`_recheck`): timed on a busy machine, it is
    timed afresh; found on a busy machine now, it is kept and what is timed now is saved
    unsettled. `ruler` (bytes/s a plain read streams; measured when None) is what our
    matrix-vector kernel's timing is checked against. Logs one line for the model at INFO,
    each group's timings at DEBUG."""
    if budget_s is None:
        budget_s = plan_seconds()
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
    tally = _Tally()
    with torch.inference_mode():
        tally.recheck = _recheck(groups, dtype, cache, timer)
        busy = tally.recheck.startswith("busy now")
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
                    plan.append(_inherited(names, len(plan), plans))
                    tally.skipped += 1
                    continue
                made = _choose(bucket_key, rows, names, group, dtype, cache, timer)
                if made.timed and made.settled and "native" in names and rows <= DECODE_ROWS:
                    made = _check_bandwidth(bucket_key, made, group, rows, dtype, cache,
                                            ruler)
                if made.timed and made.settled and busy:
                    cache.put(bucket_key, made.name, _saved(cache, bucket_key), settled=False)
                    made = Choice(made.name, timed=True, settled=False)
                tally.add(made)
                plan.append(made.name)
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
    log.info("linear kernels (%s): %d groups planned in %.2f s, %s",
             f"our {built.variant}" if built else "PyTorch's only", len(groups),
             time.perf_counter() - start, tally.summary(plans))
    return plans


def plan_seconds() -> float:
    """The plan's time budget: $MMSERVE_PLAN_SECONDS, else PLAN_SECONDS."""
    value = os.environ.get(PLAN_SECONDS_ENV)
    if value is None:
        return PLAN_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{PLAN_SECONDS_ENV} must be a number of seconds, got {value!r}") from None
    if not seconds >= 0:
        raise ValueError(f"{PLAN_SECONDS_ENV} must be at least 0, got {value!r}")
    return seconds


def _inherited(names: list[str], bucket: int, plans: dict[str, tuple]) -> str:
    """A bucket left untimed (the time budget spent) runs what most of the groups planned
    before it (the larger ones) chose at that bucket, among this group's candidates; the
    baseline where none did. On a CPU without bfloat16 arithmetic the baseline of a bfloat16
    linear is several times slower than what the timed groups chose, for every start until
    the plan is complete."""
    counts = Counter(plan[bucket] for plan in plans.values() if plan[bucket] in names)
    return counts.most_common(1)[0][0] if counts else names[0]


class _Tally:
    """What one plan did, for its log line."""

    def __init__(self) -> None:
        self.cached = self.timed = self.unsettled = self.skipped = 0
        self.recheck = ""

    def add(self, made: Choice) -> None:
        if not made.timed:
            self.cached += 1
        else:
            self.timed += 1
            self.unsettled += not made.settled

    def summary(self, plans: dict[str, tuple]) -> str:
        counts: dict[str, int] = {}
        for plan in plans.values():
            for name in plan:
                counts[name] = counts.get(name, 0) + 1
        parts = [f"{self.cached} buckets cached, {self.timed} timed"]
        if self.unsettled:
            parts.append(f"{self.unsettled} unsettled (timed again at the next start)")
        if self.skipped:
            parts.append(f"{self.skipped} past the time budget (as the groups timed before "
                         "them chose, not saved)")
        if self.recheck:
            parts.append(f"saved plan re-checked: {self.recheck}")
        chosen = ", ".join(f"{name} {n}" for name, n in
                           sorted(counts.items(), key=lambda item: -item[1]))
        return "; ".join(parts) + f"; choices: {chosen}"


# A saved plan's re-check: one group's decode-row choice timed again. Past this factor slower
# than saved, the machine is busy now; past it faster, it was busy when the plan was saved.
RECHECK_FACTOR = 2.0


def _recheck(groups: dict[str, list[nn.Module]], dtype: torch.dtype, cache: KernelCache,
             timer: Timer) -> str:
    """Time the saved choice of the largest group at one row again and compare it with its
    saved time. "" when nothing was saved for this model; "busy then: timed afresh" (every
    saved entry of this model forgotten); "busy now" (the saved plan kept); "agrees"."""
    if not groups:
        return ""
    key, group = next(iter(groups.items()))
    bucket_key = f"{key}/{BUCKETS[0]}"
    names = candidates(group[0], PROBE_ROWS[0], dtype)
    saved_choice = cache.get(bucket_key, set(names))
    if saved_choice is None or bucket_key not in cache.loaded:
        return ""
    saved = cache.seconds(bucket_key, saved_choice)
    if saved is None or saved <= 0:
        return ""
    calls = _timed_calls([saved_choice], group, PROBE_ROWS[0], dtype)
    if saved_choice not in calls:
        return ""
    now = timer(calls)[saved_choice].best
    if now * RECHECK_FACTOR < saved:
        cache.forget({f"{k}/{b}" for k in groups for b in BUCKETS})
        log.debug("saved kernel plan: %s at 1 row took %.0f us, saved %.0f us", key, now * 1e6,
                  saved * 1e6)
        return f"busy then ({saved / now:.1f}x slower than now): timed afresh"
    if now > saved * RECHECK_FACTOR:
        return f"busy now ({now / saved:.1f}x slower than saved): kept"
    return "agrees"


# Our matrix-vector kernel streams the weights as fast as a plain read does (docs/cpu-kernels.md);
# a timing of it below this share of the read ruler was taken on a busy machine.
EXPECTED_BANDWIDTH_SHARE = 0.25


def _check_bandwidth(key: str, made: Choice, group: list[nn.Module], rows: int,
                     dtype: torch.dtype, cache: KernelCache,
                     ruler: Callable[[], float] | None) -> Choice:
    """Mark a decode-row choice unsettled when our kernel's timed bandwidth falls far below a
    plain read's: its timing, and so the choice, was made on a busy machine."""
    ours = cache.seconds(key, "native")
    layers = _timing_layers(group, rows, dtype)
    streamed = sum(_nbytes(layer) for layer in layers)
    if ours is None or ours <= 0 or streamed < _RULER_BYTES // 4:
        return made  # weights that fit in cache say nothing about memory bandwidth
    expected = (ruler or read_bandwidth)()
    if streamed / ours >= EXPECTED_BANDWIDTH_SHARE * expected:
        return made
    log.debug("linear kernel %s: ours streamed %.1f GB/s against a plain read's %.1f GB/s: "
              "not final", key, streamed / ours / 1e9, expected / 1e9)
    cache.put(key, made.name, _saved(cache, key), settled=False)
    return Choice(made.name, timed=True, settled=False)


_RULER_BYTES = 64 << 20  # twice TIMED_BYTES: read from memory, not from a cache


@functools.cache
def read_bandwidth() -> float:
    """Bytes/s a plain read of a buffer larger than the caches streams (the best of a few
    reads), with our read loop where it builds, else torch's sum; measured once per process."""
    x = torch.ones(_RULER_BYTES // 4)
    kernels = native.load()
    read = (lambda: kernels.read_sum(x)) if kernels is not None else x.sum
    read()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        read()
        best = min(best, time.perf_counter() - t0)
    return _RULER_BYTES / best


def _saved(cache: KernelCache, key: str) -> dict[str, float]:
    return dict(cache.entries[key]["seconds"])


def _choose(key: str, rows: int, names: list[str], group: list[nn.Module],
            dtype: torch.dtype, cache: KernelCache, timer: Timer) -> Choice:
    """One bucket's choice for a group: cached, or timed on the group's layers. At a decode's
    rows (up to DECODE_ROWS) ours is kept unless another is faster by DECODE_MARGIN: a
    decoder whose linears all run ours takes its decode steps in one native call
    (models.kernels.native_decode), which saves more than one linear's timing shows; at more
    rows (also a short prefill chunk's) it is kept on a tie (MARGIN). Our
    quantized GEMM is kept on a tie (MARGIN) at a prefill's rows: its result is contiguous,
    where the dequantized `_t` formulations' is a transposed view whose cost falls on the
    operations after the linear, which timing it alone does not see (bench.prefill_ab at 512
    tokens: bfloat16 int8 TTFT 0.99x dense through ours, 1.22x through `dequantized_t`, the
    linears alone tying)."""
    margin = MARGIN
    for ours in ("native", "panel_gemm"):
        if ours in names:
            names = [ours] + [n for n in names if n != ours]
            margin = DECODE_MARGIN if ours == "native" and rows <= DECODE_ROWS else MARGIN
            break
    if cache.get(key, set(names)) is not None or len(names) == 1:
        return choose(key, {n: _noop for n in names}, cache, timer)
    return choose(key, _timed_calls(names, group, rows, dtype), cache, timer, margin)


def _timed_calls(names: list[str], group: list[nn.Module], rows: int,
                 dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """The call timed for each candidate of this group at `rows` rows: the same input through
    the same layers (oneDNN left out where it cannot prepack them)."""
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

    return {n: run(n) for n in names}


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


# The buckets of a decode step's rows (one per request, and a verification's drafts): up to
# models.kernels.native.FUSED_ROWS, where the one-call decode and the fused small ops serve.
DECODE_BUCKETS = tuple(i for i, rows in enumerate(PROBE_ROWS) if rows <= native.FUSED_ROWS)


def pin_decode_rows(model: nn.Module, dtype: torch.dtype) -> int:
    """Plan every linear's decode buckets to our matrix-vector kernel where it is a candidate
    (it is wherever the library builds), whatever the timing chose; returns how many bucket
    choices changed.

    Ours computes each row of its input by itself, in the same order whatever the row count,
    so a row's result does not depend on how many rows share its step. Speculative decoding
    needs exactly that: a verification's rows (a request's last token and its drafts) must sum
    as decodes of those tokens do, or a near-tie at some row flips a token that plain decoding
    would not have flipped. A PyTorch formulation measured faster at one bucket (a GEMV at one
    row, a GEMM at eight) would round a row differently there than at another."""
    changed = 0
    for group in linear_groups(model, dtype).values():
        plan = list(group[0].kernels or ())
        if not plan:
            continue
        for b in DECODE_BUCKETS:
            if plan[b] != "native" and "native" in candidates(group[0], PROBE_ROWS[b], dtype):
                plan[b] = "native"
                changed += 1
        for layer in group:
            layer.kernels = tuple(plan)
    if changed:
        log.info("speculative decoding: %d decode-row choices of the linear plan pinned to our "
                 "kernel (verified rows sum as decodes do)", changed)
    return changed
