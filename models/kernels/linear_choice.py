"""Start-up plan of every CPU linear's formulation per row-count bucket, by measurement.

Linears are grouped by weight format, dtype and shape (a decoder has a handful of groups); each
group's bucket gets the fastest candidate of models.kernels.linear, timed once on this machine
and cached on disk (models.kernels.choice), F.linear unless another wins by a margin. A group is
timed on its own layers in turn, as a decode step streams them from memory, up to a byte and a
FLOP budget per call (models.kernels.linear_timing). PyTorch's int4 kernel, which keeps a second
pack of the weight, is a candidate only for groups whose packs fit the pack budget.

Here the measuring and the changes to the layers; every threshold and decision (the time budget,
the saved plan's re-check, the bandwidth check, busy marking, the int4 pack budget) is in
models.kernels.linear_policy, on plain data.
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
    PROBE_ROWS,
    Choice,
    KernelCache,
    Timer,
    cache_path,
    choose,
    measure,
)
from models.kernels.linear import Linear, dequantization_tiles, prepack_onednn
from models.kernels.linear_policy import (
    DECODE_MAX_TOKENS,
    GEMM_PAST_TOKENS,
    MATRIX_VECTOR_MAX_TOKENS,
    PLAN_RULES,
    TILED_MAX_TOKENS,
    WHOLE_DEQUANTIZE_PAST_TOKENS,
    BucketPlan,
    GroupPlan,
    Recheck,
    bandwidth_check_applies,
    bandwidth_plausible,
    bandwidth_tells,
    decide_bucket,
    int4_pack_budget,
    pack_budget_after,
    past_time_budget,
    plan_seconds,
    recheck_saved_plan,
    summary,
    timing_order,
    torch_int4_fits,
)
from models.kernels.linear_timing import (
    int4_pack_bytes,
    read_bandwidth,
    timed_calls,
    timing_layers,
    untimed_calls,
    weight_bytes,
)
from models.kernels.quantization import QuantizedLinear

log = logging.getLogger(__name__)

# A quantized weight's dequantized GEMM is timed in the other of float32 and bfloat16 too.
OTHER_GEMM_DTYPE = {torch.float32: [(torch.bfloat16, "_bf16")],
                    torch.bfloat16: [(torch.float32, "_f32")]}


def candidates(layer: nn.Module, tokens: int, dtype: torch.dtype,
               torch_int4: bool = True) -> list[str]:
    """The formulations worth timing for this layer at `tokens` tokens, the baseline first (what
    runs when nothing beats it, or when the plan's time budget is spent). `torch_int4=False`:
    PyTorch's int4 kernel is not one (its pack of the weight would not fit the budget)."""
    ours = tokens <= MATRIX_VECTOR_MAX_TOKENS and native.load() is not None
    if layer.is_quantized:
        # PyTorch's int kernels: int8 with a scale per channel, int4 (if its pack fits)
        torch_kernel = layer.has_torch_kernel and (layer.mode == "int8" or torch_int4)
        names = ["int_kernel"] if torch_kernel else []
        # int4: our integer kernel's tiles of weight stay in cache across tokens, and it is a
        # candidate as far as the tiled dense kernel (at 128 tokens it measured ahead of the
        # dequantizing GEMMs on Qwen2.5-VL-3B's shapes on an AVX2 CPU)
        if ours or (layer.mode == "int4" and tiled_tokens(tokens)):
            names.append("native")
        if layer.mode == "int8" and tiled_tokens(tokens):
            names.append("native_rows")
        if gemm_tokens(tokens):  # an int4 layer's shape and group (32-128) it always takes
            names.append("native_gemm")
        # Dequantizing per call pays only when tokens share the weight (the int kernels' dot
        # products grow with the tokens: at a few already they can lose), and at a decode's
        # tokens only through ours, tile by tile into a reused buffer (see
        # WHOLE_DEQUANTIZE_PAST_TOKENS). x W^T is timed only for a weight of one tile: over
        # several, each tile's product is copied into a column slice of the output, which the
        # one-tile slice that timing a large layer sees would hide. The GEMMs are timed in the
        # other of float32 and bfloat16 too: a float32 model's in bfloat16 (as the int kernels
        # compute), a bfloat16 model's in float32 (CPUs without bfloat16 arithmetic).
        tiled = native.load() is not None
        if tokens > 1 and (tiled or tokens > WHOLE_DEQUANTIZE_PAST_TOKENS):
            for gemm_dtype, suffix in [(dtype, "")] + OTHER_GEMM_DTYPE.get(dtype, []):
                if len(dequantization_tiles(layer.out_features, layer.in_features,
                                            gemm_dtype)) == 1:
                    names.append("dequantized" + suffix)
                names.append("dequantized_t" + suffix)
        if tokens > GEMM_PAST_TOKENS and panel_gemm_takes(layer):
            names.append("panel_gemm")
        return names or ["dequantized_t"]  # the weight dequantized per call, where nothing else
    names = [BASELINE]
    if dtype in (torch.float32, torch.bfloat16):
        if tokens == 1 or not layer.contiguous_output:
            names.append("mv" if tokens == 1 else "matmul_t")
        if onednn_prepacks(dtype):
            names.append("onednn")
        if ours:
            names.append("native")
        if tiled_tokens(tokens):
            names.append("native_rows")
        if gemm_tokens(tokens):
            names.append("native_gemm")
        if dtype == torch.bfloat16 and tokens > 1:
            names.append("widened")
    return names


def tiled_tokens(tokens: int) -> bool:
    """Whether our register-tiled kernel is a candidate at `tokens` tokens."""
    return DECODE_MAX_TOKENS < tokens <= TILED_MAX_TOKENS and native.load() is not None


def gemm_tokens(tokens: int) -> bool:
    """Whether our packed-panel GEMM is a candidate at `tokens` tokens."""
    return tokens > GEMM_PAST_TOKENS and native.load() is not None


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


def choose_linear_kernels(model: nn.Module, dtype: torch.dtype,
                          cache: KernelCache | None = None, timer: Timer = measure,
                          budget_s: float | None = None,
                          ruler: Callable[[], float] | None = None) -> dict[str, tuple]:
    """Set every CPU linear's `kernels` (one formulation per bucket): cached choices are
    reused, new ones timed and saved. Returns {group key: choices per bucket}.

    A saved plan is first re-checked on one group: timed on a busy machine, it is timed
    afresh; found on a busy machine now, it is kept and what is timed now is saved
    unsettled. `ruler` (bytes/s a plain read streams; measured when None) is what our
    matrix-vector kernel's timing is checked against. Logs one line for the model at INFO,
    each group's timings at DEBUG."""
    built = native.load()  # built (once) before the clock starts: it is not the plan's time
    if cache is None:
        cache = KernelCache(cache_path(native_build=built.build_id if built else None,
                                       rules=PLAN_RULES))
    # The largest groups first: if the budget runs out, it is spent where the bytes are.
    groups = dict(sorted(linear_groups(model, dtype).items(),
                         key=lambda item: -sum(weight_bytes(layer) for layer in item[1])))
    planner = _Planner(dtype, cache, timer, ruler,
                       plan_seconds() if budget_s is None else budget_s)
    pack_budget = int4_pack_budget(sum(int4_pack_bytes(group) for group in groups.values()))
    plans: list[GroupPlan] = []
    with torch.inference_mode():
        recheck = _recheck(groups, dtype, cache, timer)
        for key, group in groups.items():
            pack = int4_pack_bytes(group)
            plan = planner.group(key, group, torch_int4_fits(pack, pack_budget),
                                 busy_now=recheck is not None and recheck.busy_now)
            pack_budget = pack_budget_after(pack_budget, pack, plan.kernels)
            apply_group_plan(group, plan)
            plans.append(plan)
    cache.save()
    log.info("linear kernels (%s): %d groups planned in %.2f s, %s",
             f"our {built.variant}" if built else "PyTorch's only", len(groups),
             time.perf_counter() - planner.start, summary(plans, recheck))
    return {plan.key: plan.kernels for plan in plans}


def apply_group_plan(group: list[nn.Module], plan: GroupPlan) -> None:
    """Set the group's layers' `kernels` and keep only the packs the plan reads: oneDNN's
    prepacked weight where a bucket runs "onednn", PyTorch's int4 pack where one runs
    "int_kernel" (both are otherwise made only for timing)."""
    kernels = plan.kernels
    for layer in group:
        if "onednn" in kernels:
            prepack_onednn(layer)
        elif not layer.is_quantized:
            layer.packed = None
        elif "int_kernel" not in kernels:
            layer.torch_packed = None
        layer.kernels = kernels


class _Planner:
    """Measures each bucket of a group and asks models.kernels.linear_policy what to run."""

    def __init__(self, dtype: torch.dtype, cache: KernelCache, timer: Timer,
                 ruler: Callable[[], float] | None, budget_s: float) -> None:
        self.dtype, self.cache, self.timer, self.ruler = dtype, cache, timer, ruler
        self.budget_s = budget_s
        self.start = time.perf_counter()
        self.planned: dict[str, tuple[str, ...]] = {}  # the groups planned so far

    def group(self, key: str, group: list[nn.Module], torch_int4: bool,
              busy_now: bool) -> GroupPlan:
        buckets = tuple(
            self._bucket(f"{key}/{bucket}", index, tokens, group, torch_int4, busy_now)
            for index, (bucket, tokens) in enumerate(zip(BUCKETS, PROBE_ROWS, strict=True)))
        plan = GroupPlan(key, buckets)
        self.planned[key] = plan.kernels
        return plan

    def _bucket(self, key: str, index: int, tokens: int, group: list[nn.Module],
                torch_int4: bool, busy_now: bool) -> BucketPlan:
        names = candidates(group[0], tokens, self.dtype, torch_int4)
        cached = self.cache.get(key, set(names)) is not None
        if past_time_budget(time.perf_counter() - self.start, self.budget_s, cached):
            return decide_bucket(None, names, index, self.planned)
        made = self._choose(key, tokens, names, group)
        measured = BucketPlan(made.name, "timed" if made.timed else "cached", made.settled)
        bandwidth_ok = (not bandwidth_check_applies(measured, names, tokens)
                        or self._bandwidth_ok(key, group, tokens))
        plan = decide_bucket(measured, names, index, self.planned, busy_now, bandwidth_ok)
        if measured.settled and not plan.settled:  # saved, to be timed again at the next start
            self.cache.put(key, plan.kernel, dict(self.cache.entries[key]["seconds"]),
                           settled=False, timings=self.cache.timings(key))
        return plan

    def _choose(self, key: str, tokens: int, names: list[str],
                group: list[nn.Module]) -> Choice:
        """One bucket's choice: cached, or timed on the group's layers (the preferred
        candidate and its margin by linear_policy.timing_order)."""
        names, margin = timing_order(names, tokens)
        if self.cache.get(key, set(names)) is not None or len(names) == 1:
            return choose(key, untimed_calls(names), self.cache, self.timer)
        return choose(key, timed_calls(names, group, tokens, self.dtype), self.cache,
                      self.timer, margin)

    def _bandwidth_ok(self, key: str, group: list[nn.Module], tokens: int) -> bool:
        """Whether our kernel's timing streamed the weights plausibly fast (measuring the read
        ruler only where the timing can tell)."""
        ours = self.cache.seconds(key, "native")
        streamed = sum(weight_bytes(layer)
                       for layer in timing_layers(group, tokens, self.dtype))
        if not bandwidth_tells(streamed, ours):
            return True
        expected = (self.ruler or read_bandwidth)()
        if bandwidth_plausible(streamed, ours, expected):
            return True
        log.debug("linear kernel %s: ours streamed %.1f GB/s against a plain read's %.1f GB/s: "
                  "not final", key, streamed / ours / 1e9, expected / 1e9)
        return False


def _recheck(groups: dict[str, list[nn.Module]], dtype: torch.dtype, cache: KernelCache,
             timer: Timer) -> Recheck | None:
    """Time the saved choice of the largest group at one token again and judge the saved plan
    by it (linear_policy.recheck_saved_plan); None when nothing was saved for this model. A
    plan saved on a busy machine is forgotten here (every saved entry of this model)."""
    if not groups:
        return None
    key, group = next(iter(groups.items()))
    bucket_key = f"{key}/{BUCKETS[0]}"
    names = candidates(group[0], PROBE_ROWS[0], dtype)
    saved_choice = cache.get(bucket_key, set(names))
    if saved_choice is None or bucket_key not in cache.loaded:
        return None
    saved = cache.seconds(bucket_key, saved_choice)
    if saved is None or saved <= 0:
        return None
    calls = timed_calls([saved_choice], group, PROBE_ROWS[0], dtype)
    if saved_choice not in calls:
        return None
    recheck = recheck_saved_plan(saved, timer(calls)[saved_choice].best)
    if recheck.forgets_saved_plan:
        cache.forget({f"{k}/{b}" for k in groups for b in BUCKETS})
        log.debug("saved kernel plan: %s at 1 token took %.0f us, saved %.0f us", key,
                  recheck.now_s * 1e6, saved * 1e6)
    return recheck


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
