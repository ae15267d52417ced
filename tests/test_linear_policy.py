"""The linear plan's policy (models.kernels.linear_policy) on literal measurements: each stage
(time budget, saved-plan re-check, bandwidth check, busy marking, int4 pack budget) decides from
plain numbers, with no layer and no timing."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from models.kernels import linear_policy as policy
from models.kernels.choice import BASELINE, BUCKET_LAST_ROWS, BUCKETS, PROBE_ROWS
from models.kernels.linear_policy import BucketPlan, GroupPlan


def test_the_policy_is_plain_python():
    """No torch and no other module of ours: its decisions are made on plain numbers."""
    tree = ast.parse(Path(policy.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert {m.split(".")[0] for m in imported} <= {"__future__", "os", "collections",
                                                   "dataclasses"}


def test_token_limits_end_buckets():
    """Each candidacy limit is a bucket's last token count, so every token count of a bucket has
    the candidates its probe was timed with."""
    for limit in (policy.DECODE_MAX_TOKENS, policy.MATRIX_VECTOR_MAX_TOKENS,
                  policy.TILED_MAX_TOKENS, policy.GEMM_PAST_TOKENS,
                  policy.WHOLE_DEQUANTIZE_PAST_TOKENS):
        assert limit in BUCKET_LAST_ROWS
    assert len(PROBE_ROWS) == len(BUCKETS)


def test_plans_are_validated_and_frozen():
    with pytest.raises(ValueError, match="source"):
        BucketPlan("mv", "guessed")
    with pytest.raises(ValueError, match="kernel"):
        BucketPlan("", "timed")
    plan = GroupPlan("dense/float32/8x8", (BucketPlan("mv", "timed"), BucketPlan("native",
                                                                                "cached")))
    assert plan.kernels == ("mv", "native")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.key = "other"


def test_a_saved_plan_re_checked():
    agrees = policy.recheck_saved_plan(saved_s=1e-4, now_s=1.5e-4)
    assert agrees.verdict == "agrees" and not agrees.busy_now and not agrees.forgets_saved_plan
    busy_then = policy.recheck_saved_plan(saved_s=1e-3, now_s=1e-4)  # 10x faster now
    assert busy_then.forgets_saved_plan and not busy_then.busy_now
    assert busy_then.describe() == "busy then (10.0x slower than now): timed afresh"
    busy_now = policy.recheck_saved_plan(saved_s=1e-4, now_s=3e-4)
    assert busy_now.busy_now and busy_now.describe().startswith("busy now (3.0x")
    # exactly RECHECK_FACTOR either way still agrees
    assert policy.recheck_saved_plan(2.0, 1.0).verdict == "agrees"
    assert policy.recheck_saved_plan(1.0, 2.0).verdict == "agrees"


def test_a_busy_machine_marks_what_is_timed_now_unsettled():
    timed = BucketPlan("native", "timed")
    assert policy.mark_busy(timed, busy_now=True) == BucketPlan("native", "timed", False)
    assert policy.mark_busy(timed, busy_now=False) == timed
    cached = BucketPlan("mv", "cached")  # the saved plan is kept as it was
    assert policy.mark_busy(cached, busy_now=True) == cached
    decided = policy.decide_bucket(timed, ["F.linear", "native"], 0, {}, busy_now=True)
    assert not decided.settled and decided.kernel == "native"


def test_the_pack_budget_cuts_pytorchs_int4_packing():
    """Of 1000 int4 bytes a tenth may be packed again: a 900-byte group of experts is refused,
    a 60-byte group fits and spends its pack when it takes the int kernel, after which a second
    60-byte group no longer fits."""
    budget = policy.int4_pack_budget(1000)
    assert budget == pytest.approx(100)
    assert not policy.torch_int4_fits(900, budget)
    assert policy.torch_int4_fits(60, budget)
    assert policy.pack_budget_after(budget, 60, ("native", "dequantized")) == budget
    budget = policy.pack_budget_after(budget, 60, ("native", "int_kernel"))
    assert budget == pytest.approx(40) and not policy.torch_int4_fits(60, budget)
    assert policy.torch_int4_fits(0, 0)  # a dense group adds no pack


def test_the_time_budget_leaves_only_uncached_buckets_untimed():
    assert policy.past_time_budget(elapsed_s=9.0, budget_s=8.0, cached=False)
    assert not policy.past_time_budget(elapsed_s=9.0, budget_s=8.0, cached=True)
    assert not policy.past_time_budget(elapsed_s=1.0, budget_s=8.0, cached=False)
    plans = {"big": ("native", "widened"), "mid": ("mv", "widened")}
    inherited = policy.decide_bucket(None, [BASELINE, "widened"], 1, plans)
    assert inherited == BucketPlan("widened", "inherited")


def test_our_kernel_far_below_a_plain_reads_bandwidth_is_not_final():
    timed = BucketPlan("native", "timed")
    assert policy.bandwidth_check_applies(timed, ["F.linear", "native"], tokens=4)
    assert not policy.bandwidth_check_applies(timed, ["F.linear", "native"], tokens=32)
    assert not policy.bandwidth_check_applies(timed, ["F.linear", "mv"], tokens=1)
    assert not policy.bandwidth_check_applies(BucketPlan("native", "cached"), ["native"], 1)
    streamed = 32 << 20
    assert not policy.bandwidth_tells(1 << 20, 1e-3)  # fits in cache: says nothing
    assert not policy.bandwidth_tells(streamed, None)
    assert policy.bandwidth_tells(streamed, streamed / 1e9)
    # 1 GB/s against a 20 GB/s read: a busy machine; against 2 GB/s: fine
    assert not policy.bandwidth_plausible(streamed, streamed / 1e9, 20e9)
    assert policy.bandwidth_plausible(streamed, streamed / 1e9, 2e9)
    decided = policy.decide_bucket(timed, ["F.linear", "native"], 0, {}, bandwidth_ok=False)
    assert decided == BucketPlan("native", "timed", settled=False)


def test_ours_is_timed_first_with_its_margin():
    names, margin = policy.timing_order([BASELINE, "mv", "native"], tokens=1)
    assert names == ["native", BASELINE, "mv"] and margin == policy.DECODE_MARGIN
    assert policy.timing_order([BASELINE, "native"], tokens=32)[1] == policy.MARGIN
    names, margin = policy.timing_order(["int_kernel", "dequantized_t", "panel_gemm"], 512)
    assert names[0] == "panel_gemm" and margin == policy.MARGIN
    assert policy.timing_order([BASELINE, "mv"], 1) == ([BASELINE, "mv"], policy.MARGIN)


def test_the_summary_counts_each_source():
    plans = [GroupPlan("a", (BucketPlan("native", "cached"), BucketPlan("mv", "timed", False))),
             GroupPlan("b", (BucketPlan("native", "timed"), BucketPlan("mv", "inherited")))]
    line = policy.summary(plans, policy.recheck_saved_plan(1.0, 1.0))
    assert line == ("1 buckets cached, 2 timed; 1 unsettled (timed again at the next start); "
                    "1 past the time budget (as the groups timed before them chose, not saved); "
                    "saved plan re-checked: agrees; choices: native 2, mv 2")
