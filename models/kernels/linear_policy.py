"""The linear plan's policy: every threshold it applies and every decision it makes, as plain
data in and out (no torch, no clock), so that each rule is tested on literal measurements.

models.kernels.linear_choice measures (times candidates, reads the saved plan, streams a
buffer) and applies what is decided here to the layers. A decision is a `BucketPlan` per
row-count bucket (models.kernels.choice.BUCKETS), a `GroupPlan` per group of same-shaped
linears; the stages, in the order a plan meets them:

1. the saved plan's re-check (`recheck_saved_plan`): one saved choice timed again says whether
   the machine is busy now, or was when the plan was saved;
2. the int4 pack budget (`int4_pack_budget`, `torch_int4_fits`, `pack_budget_after`): which
   groups may take PyTorch's int4 kernel, whose pack is a second copy of the weight;
3. the time budget (`past_time_budget`, `inherited_kernel`): buckets past it are not timed;
4. the bandwidth check (`bandwidth_check_applies`, `bandwidth_plausible`): a decode-row
   timing of ours far below a plain read's bandwidth was taken on a busy machine;
5. busy marking (`mark_busy`): what is timed while the machine is busy is not saved final.

Throughout, "tokens" counts the rows of a linear's input (one per token), "channels" a
weight's output channels.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

# --- Which formulations are candidates, by the tokens of the input --------------------------
# Each limit is the last token count of a bucket (models.kernels.choice.BUCKETS), so that every
# token count of a bucket has the candidates its probe was timed with.

# A decode step of a few requests (the 2-8 bucket); more tokens may be a prefill chunk.
DECODE_MAX_TOKENS = 8
# Our matrix-vector kernel streams each weight row once and reuses it from cache for every token,
# where a GEMM (a bfloat16 one on a CPU without bfloat16 arithmetic above all, which widens the
# whole weight first) or a dequantized GEMM reads or writes the weight several times: short
# prefill chunks (a second turn's new text) and many concurrent decodes, up to the 9-64 bucket.
MATRIX_VECTOR_MAX_TOKENS = 64
# Our register-tiled kernel (models/kernels/cpu/linear_rows.c) past a decode's tokens up to the
# 65-256 bucket: a short prefill chunk, many requests' decodes; longer prefills are a GEMM's.
# Our int4 matrix-vector kernel goes as far (its tiles of weight stay in cache across tokens).
TILED_MAX_TOKENS = 256
# Our packed-panel GEMM (models/kernels/cpu/gemm_dense.c) past a decode's tokens: a prefill's, a
# vision tower's, a short chunk's, where it packs each strip of the weight just before its tiles
# read it. Our panel-dequantizing GEMM (gemm_quantized.c) likewise.
GEMM_PAST_TOKENS = DECODE_MAX_TOKENS
# Where our dequantizer does not build, PyTorch's dequantizes the whole weight per call: a fresh
# copy of a large weight (an LM head) every decode step, which timing a slice of it does not see;
# a candidate only past the 9-64 bucket.
WHOLE_DEQUANTIZE_PAST_TOKENS = 64

# --- How much faster a candidate must be (fractions of the preferred one's time) -------------
MARGIN = 0.05  # another candidate must beat the baseline (or ours, preferred) by this fraction
# At a decode's tokens, how much faster than ours another kernel must be to be chosen: one layer
# group planned to PyTorch's costs every decode step the one native call through all layers
# (models.layers.native_decode), whose saving no single linear's timing shows (a group 9%
# faster through PyTorch's int4 kernel, within timing noise, made a whole step 1.6x slower).
DECODE_MARGIN = 0.25

# --- The time budget (seconds) ----------------------------------------------------------------
# Past this, buckets left unmeasured take the timed groups' choice, unsaved (timed at the next
# start); $MMSERVE_PLAN_SECONDS sets another (a first start that plans a large model whole).
# A first start is the slow one anyway (it builds the C kernels); what is left untimed makes the
# second start slow too, so the budget holds a whole plan of the usual shapes (a bfloat16
# checkpoint at Qwen2.5-VL-3B's widths took about 12 s on a 2-core Zen 3).
PLAN_SECONDS = 15.0
PLAN_SECONDS_ENV = "MMSERVE_PLAN_SECONDS"

# --- Busy-machine checks (factors and bytes) -------------------------------------------------
# A saved plan's re-check: one group's decode-row choice timed again. Past this factor slower
# than saved, the machine is busy now; past it faster, it was busy when the plan was saved.
RECHECK_FACTOR = 2.0
# Our matrix-vector kernel streams the weights as fast as a plain read does (docs/cpu-kernels.md);
# a timing of it below this share of the read ruler's bandwidth was taken on a busy machine.
EXPECTED_BANDWIDTH_SHARE = 0.25
# Fewer weight bytes than this per timed call may sit in the caches: their timing says nothing
# about memory bandwidth (a quarter of models.kernels.linear_timing.READ_RULER_BYTES).
BANDWIDTH_MIN_STREAMED_BYTES = 16 << 20

# --- Memory (a share of bytes) ----------------------------------------------------------------
# PyTorch's int4 kernel reads a pack of its own, a second copy of the weight beside ours: the
# groups planned to it may add at most this share of the model's int4 bytes (the largest groups,
# a mixture's experts or a large model's layers, keep one copy).
TORCH_INT4_PACK_SHARE = 0.1

# The version of the candidates and choosing rules, part of the cache file's name: bump it when
# they change, so that choices made under the old ones are timed afresh.
PLAN_RULES = 9

SOURCES = ("cached", "timed", "inherited")


@dataclass(frozen=True)
class BucketPlan:
    """One bucket's decision for a group: the formulation (`kernel`), where it came from
    ("cached": the saved plan; "timed": measured now and saved; "inherited": past the time
    budget, the timed groups' choice, not saved) and whether it is final (`settled`; else it
    is used now and timed again at the next start)."""

    kernel: str
    source: str
    settled: bool = True

    def __post_init__(self) -> None:
        if not self.kernel:
            raise ValueError("a bucket plan needs a kernel name")
        if self.source not in SOURCES:
            raise ValueError(f"bucket plan source must be one of {SOURCES}, got {self.source!r}")


@dataclass(frozen=True)
class GroupPlan:
    """A group's decisions, one per bucket (`key`: format/dtype/out x in)."""

    key: str
    buckets: tuple[BucketPlan, ...]

    @property
    def kernels(self) -> tuple[str, ...]:
        """The formulation per bucket, as a layer's `kernels`."""
        return tuple(bucket.kernel for bucket in self.buckets)


@dataclass(frozen=True)
class Recheck:
    """What timing one saved choice again said: `verdict` "agrees", "busy then" (now faster by
    more than RECHECK_FACTOR: the plan was saved on a busy machine, every saved entry of the
    model is timed afresh) or "busy now" (slower by more: the saved plan is kept, and what is
    timed now is saved unsettled)."""

    verdict: str
    saved_s: float
    now_s: float

    @property
    def busy_now(self) -> bool:
        return self.verdict == "busy now"

    @property
    def forgets_saved_plan(self) -> bool:
        return self.verdict == "busy then"

    def describe(self) -> str:
        if self.verdict == "busy then":
            return f"busy then ({self.saved_s / self.now_s:.1f}x slower than now): timed afresh"
        if self.verdict == "busy now":
            return f"busy now ({self.now_s / self.saved_s:.1f}x slower than saved): kept"
        return "agrees"


def recheck_saved_plan(saved_s: float, now_s: float) -> Recheck:
    """Stage 1: the verdict on a saved plan from one saved choice's saved and present time."""
    if now_s * RECHECK_FACTOR < saved_s:
        return Recheck("busy then", saved_s, now_s)
    if now_s > saved_s * RECHECK_FACTOR:
        return Recheck("busy now", saved_s, now_s)
    return Recheck("agrees", saved_s, now_s)


def int4_pack_budget(model_int4_bytes: float) -> float:
    """Stage 2: the bytes PyTorch's int4 packs may add for the whole model."""
    return TORCH_INT4_PACK_SHARE * model_int4_bytes


def torch_int4_fits(pack_bytes: float, budget_bytes: float) -> bool:
    """Whether a group whose int4 pack would add `pack_bytes` may take PyTorch's int4 kernel."""
    return pack_bytes <= budget_bytes


def pack_budget_after(budget_bytes: float, pack_bytes: float, kernels: Sequence[str]) -> float:
    """The budget left once a group is planned: its pack is spent where a bucket took
    PyTorch's int kernel (the pack is kept), else it is dropped and costs nothing."""
    return budget_bytes - pack_bytes if "int_kernel" in kernels else budget_bytes


def plan_seconds() -> float:
    """Stage 3's budget: $MMSERVE_PLAN_SECONDS, else PLAN_SECONDS."""
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


def past_time_budget(elapsed_s: float, budget_s: float, cached: bool) -> bool:
    """Stage 3: whether a bucket is left untimed (a cached one is always read)."""
    return not cached and elapsed_s > budget_s


def inherited_kernel(candidates: Sequence[str], bucket: int,
                     plans: Mapping[str, Sequence[str]]) -> str:
    """A bucket left untimed runs what most of the groups planned before it (the larger ones)
    chose at that bucket, among this group's candidates; the baseline (the first candidate)
    where none did. On a CPU without bfloat16 arithmetic the baseline of a bfloat16 linear is
    several times slower than what the timed groups chose, for every start until the plan is
    complete."""
    counts = Counter(plan[bucket] for plan in plans.values() if plan[bucket] in candidates)
    return counts.most_common(1)[0][0] if counts else candidates[0]


def timing_order(candidates: Sequence[str], tokens: int) -> tuple[list[str], float]:
    """The candidates with the preferred one first (the one kept unless another wins by the
    margin) and that margin. Ours is preferred where it is a candidate: at a decode's tokens
    by DECODE_MARGIN (a decoder whose linears all run ours takes its decode steps in one native
    call, models.layers.native_decode, which saves more than one linear's timing shows), past
    them on a tie (MARGIN). Our quantized GEMM is preferred on a tie at a prefill's tokens: its
    result is contiguous, where the dequantized `_t` formulations' is a transposed view whose
    cost falls on the operations after the linear, which timing it alone does not see
    (bench.prefill_ab at 512 tokens: bfloat16 int8 TTFT 0.99x dense through ours, 1.22x
    through `dequantized_t`, the linears alone tying). Else the baseline, on a tie."""
    names = list(candidates)
    for ours in ("native", "panel_gemm"):
        if ours in names:
            names = [ours] + [n for n in names if n != ours]
            decode = ours == "native" and tokens <= DECODE_MAX_TOKENS
            return names, DECODE_MARGIN if decode else MARGIN
    return names, MARGIN


def bandwidth_check_applies(measured: BucketPlan, candidates: Sequence[str],
                            tokens: int) -> bool:
    """Stage 4 applies to a settled choice timed now at a decode's tokens with ours among the
    candidates (ours streams the weight once: its timing measures the memory's bandwidth)."""
    return (measured.source == "timed" and measured.settled and "native" in candidates
            and tokens <= DECODE_MAX_TOKENS)


def bandwidth_tells(streamed_bytes: int, ours_s: float | None) -> bool:
    """Whether ours' timing over `streamed_bytes` of weights says anything about bandwidth."""
    return ours_s is not None and ours_s > 0 and streamed_bytes >= BANDWIDTH_MIN_STREAMED_BYTES


def bandwidth_plausible(streamed_bytes: int, ours_s: float, read_bytes_per_s: float) -> bool:
    """Stage 4: whether ours streamed at least EXPECTED_BANDWIDTH_SHARE of a plain read."""
    return streamed_bytes / ours_s >= EXPECTED_BANDWIDTH_SHARE * read_bytes_per_s


def mark_busy(plan: BucketPlan, busy_now: bool) -> BucketPlan:
    """Stage 5: a choice timed now on a busy machine is used but not saved final."""
    if busy_now and plan.source == "timed" and plan.settled:
        return replace(plan, settled=False)
    return plan


def decide_bucket(measured: BucketPlan | None, candidates: Sequence[str], bucket: int,
                  plans: Mapping[str, Sequence[str]], busy_now: bool = False,
                  bandwidth_ok: bool = True) -> BucketPlan:
    """One bucket's decision. `measured`: the cached or timed choice, None when the bucket was
    past the time budget (it inherits, from `plans`, the groups planned before); `busy_now`:
    the re-check's verdict; `bandwidth_ok`: stage 4's (True where it does not apply)."""
    if measured is None:
        return BucketPlan(inherited_kernel(candidates, bucket, plans), "inherited")
    if not bandwidth_ok and measured.source == "timed":
        measured = replace(measured, settled=False)
    return mark_busy(measured, busy_now)


def summary(plans: Sequence[GroupPlan], recheck: Recheck | None) -> str:
    """What a plan did, for its one log line: how many buckets were read, timed, left unsettled
    and past the budget, the re-check's verdict, and how often each formulation was chosen."""
    buckets = [bucket for plan in plans for bucket in plan.buckets]
    cached = sum(b.source == "cached" for b in buckets)
    timed = [b for b in buckets if b.source == "timed"]
    unsettled = sum(not b.settled for b in timed)
    skipped = sum(b.source == "inherited" for b in buckets)
    parts = [f"{cached} buckets cached, {len(timed)} timed"]
    if unsettled:
        parts.append(f"{unsettled} unsettled (timed again at the next start)")
    if skipped:
        parts.append(f"{skipped} past the time budget (as the groups timed before them chose, "
                     "not saved)")
    if recheck is not None:
        parts.append(f"saved plan re-checked: {recheck.describe()}")
    counts = Counter(b.kernel for b in buckets)
    chosen = ", ".join(f"{name} {n}" for name, n in
                       sorted(counts.items(), key=lambda item: -item[1]))
    return "; ".join(parts) + f"; choices: {chosen}"
