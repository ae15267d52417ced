"""Kernel choice bookkeeping with fake timings: buckets, the margin over F.linear, the on-disk
cache (its path, reuse, stale entries) and the start-up plan; no real timing is asserted."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from models.kernels import choice as kernel_choice
from models.kernels import native
from models.kernels.choice import (
    BASELINE,
    BUCKETS,
    PROBE_ROWS,
    KernelCache,
    Timing,
    bucket_index,
    cache_path,
    choose,
    pick,
)
from models.kernels.linear import MIN_TILE_CHANNELS, TILE_BYTES, Linear, dequantization_tiles
from models.kernels.linear_choice import (
    candidates,
    choose_linear_kernels,
    panel_gemm_takes,
)
from models.kernels.linear_policy import DECODE_MAX_TOKENS, inherited_kernel
from models.kernels.quantization import QuantizedLinear


def test_buckets():
    rows = (1, 2, 8, 9, 64, 65, 256, 257, 1024, 1025, 8192)
    assert [bucket_index(r) for r in rows] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    assert len(BUCKETS) == len(PROBE_ROWS) == 6
    assert [bucket_index(r) for r in PROBE_ROWS] == list(range(len(BUCKETS)))


def test_pick_prefers_f_linear_within_the_margin():
    assert pick({BASELINE: 1.0, "matmul_t": 0.97}) == BASELINE
    assert pick({BASELINE: 1.0, "matmul_t": 0.90, "onednn": 0.5}) == "onednn"
    # A quantized layer's baseline is its int kernel; dequantizing per call must win clearly.
    assert pick({"int_kernel": 1.0, "dequantized": 0.97}, "int_kernel") == "int_kernel"
    assert pick({"int_kernel": 1.0, "dequantized": 0.5}, "int_kernel") == "dequantized"
    with pytest.raises(ValueError):
        pick({})


def test_cache_path_names_cpu_and_torch_version(monkeypatch, tmp_path):
    monkeypatch.setenv(kernel_choice.CACHE_ENV, str(tmp_path))
    path = cache_path("AMD EPYC 9B14 / 2 cores", "2.13.0+cpu")
    assert path.parent == tmp_path
    assert path.name == "kernels-AMD_EPYC_9B14_2_cores-2.13.0+cpu.json"
    assert cache_path().name.startswith("kernels-") and torch.__version__ in cache_path().name
    # A build of our own kernels gets a file of its own: choices made without it are stale.
    assert cache_path("c", "t", native_build="ab12").name == "kernels-c-t-native-ab12.json"
    assert cache_path("c", "t", "ab12", rules=2).name == "kernels-c-t-native-ab12-plan2.json"


class FakeTimer:
    """Returns fixed seconds per candidate name (repeats that agree) and counts the calls."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds, self.calls = seconds, 0

    def __call__(self, fns):
        self.calls += 1
        return {name: Timing((self.seconds.get(name, 1.0),)) for name in fns}


def test_choose_times_once_then_reads_the_file(tmp_path):
    path = tmp_path / "kernels.json"
    timer = FakeTimer({BASELINE: 1.0, "mv": 0.5})
    fns = {BASELINE: lambda: None, "mv": lambda: None}
    cache = KernelCache(path)
    assert choose("k", fns, cache, timer).name == "mv"
    cache.save()
    assert json.loads(path.read_text())["choices"]["k"]["choice"] == "mv"
    again = FakeTimer({BASELINE: 0.1})
    made = choose("k", fns, KernelCache(path), again)
    assert made.name == "mv" and not made.timed and again.calls == 0
    # A cached name that is no candidate here (say, oneDNN missing) is measured again.
    assert choose("k", {BASELINE: lambda: None}, KernelCache(path), again).name == BASELINE


def test_a_winner_must_beat_f_linear_twice(tmp_path):
    rounds = iter([{BASELINE: Timing((1.0,)), "mv": Timing((0.5,))},
                   {BASELINE: Timing((1.0,)), "mv": Timing((1.2,))}])
    fns = {BASELINE: lambda: None, "mv": lambda: None}
    cache = KernelCache(tmp_path / "k.json")
    assert choose("k", fns, cache, lambda candidates: next(rounds)).name == BASELINE
    assert cache.entries["k"]["seconds"]["mv"] == 1.2


def test_unreadable_cache_is_empty(tmp_path):
    path = tmp_path / "kernels.json"
    path.write_text("{not json")
    assert KernelCache(path).entries == {}


class Tiny(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.a = nn.ModuleList(Linear(32, 48).to(dtype) for _ in range(3))
        self.b = Linear(48, 32, bias=False).to(dtype)
        self.q = QuantizedLinear(torch.randn(64, 32), None, "int8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plan_follows_fake_timings_and_outputs_stay_f_linear(tmp_path, dtype):
    torch.manual_seed(0)
    model = Tiny(dtype)
    timer = FakeTimer({"matmul_t": 0.5, "mv": 0.5, "int_kernel": 0.5})
    plans = choose_linear_kernels(model, dtype, KernelCache(tmp_path / "k.json"), timer)
    expected = ("mv",) + ("matmul_t",) * (len(BUCKETS) - 1)
    assert plans[f"dense/{str(dtype)[6:]}/48x32"] == expected
    assert all(layer.kernels == expected for layer in model.a)
    assert model.q.kernels == ("int_kernel",) * len(BUCKETS)
    for rows in (1, 3, 20, 100):
        x = torch.randn(rows, 32, dtype=dtype)
        layer = model.a[1]
        tol = 1e-5 if dtype == torch.float32 else 0.05
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias),
                                   atol=tol, rtol=tol)
    # A second start reads every choice from the file: it only times one saved choice again
    # (the re-check), which agrees within RECHECK_FACTOR.
    again = FakeTimer({"mv": 0.9})
    again_plans = choose_linear_kernels(Tiny(dtype), dtype, KernelCache(tmp_path / "k.json"),
                                        again)
    assert again_plans == plans
    assert again.calls == 1


def test_an_encoders_batch_runs_its_planned_kernel_row_by_row(monkeypatch):
    """A 3-D input [B, T, W] (an audio encoder's batch) runs the formulation planned for its
    B * T rows, not F.linear; the result is F.linear's."""
    from models.kernels import linear as linear_module
    from models.kernels.linear import EncoderLinear

    layer = EncoderLinear(32, 24)
    layer.kernels = ("mv",) + ("widened",) * (len(BUCKETS) - 1)
    seen = []
    widened = linear_module.KERNELS["widened"]
    monkeypatch.setitem(linear_module.KERNELS, "widened",
                        lambda lin, x: seen.append(tuple(x.shape)) or widened(lin, x))
    x = torch.randn(3, 5, 32)
    out = layer(x)
    assert seen == [(15, 32)] and out.shape == (3, 5, 24)
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias))
    layer.kernels = None  # unplanned: F.linear
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert seen == [(15, 32)]


def test_plan_keeps_f_linear_when_nothing_wins_by_the_margin(tmp_path):
    """...except at a decode's rows, where ours is kept on a tie (models.layers.native_decode), and
    at a prefill's for quantized layers, where our GEMM is (its result is contiguous)."""
    model = Tiny(torch.float32)
    choose_linear_kernels(model, torch.float32, KernelCache(tmp_path / "k.json"),
                 FakeTimer({BASELINE: 1.0, "matmul_t": 0.99, "mv": 0.98, "onednn": 0.97,
                            "native": 0.99, "int_kernel": 1.0}))
    ours = ["native" in candidates(model.b, rows, torch.float32) for rows in PROBE_ROWS]
    assert model.b.kernels == tuple("native" if o else BASELINE for o in ours)
    assert model.q.kernels[0] == ("native" if ours[0] else "int_kernel")
    # At a decode's rows ours is kept against PyTorch's faster by less than DECODE_MARGIN
    # (losing the one-call decode costs more); past them (a short prefill chunk too) only on
    # a tie...
    model = Tiny(torch.float32)
    choose_linear_kernels(model, torch.float32, KernelCache(tmp_path / "k1.json"),
                 FakeTimer({BASELINE: 1.0, "native": 1.2, "int_kernel": 1.0}))
    decode = [o and rows <= DECODE_MAX_TOKENS for o, rows in zip(ours, PROBE_ROWS, strict=True)]
    assert model.b.kernels == tuple("native" if o else BASELINE for o in decode)
    # ...and PyTorch's beating ours by more are chosen.
    model = Tiny(torch.float32)
    choose_linear_kernels(model, torch.float32, KernelCache(tmp_path / "k2.json"),
                 FakeTimer({BASELINE: 1.0, "native": 1.5, "int_kernel": 1.0}))
    assert model.b.kernels == (BASELINE,) * len(BUCKETS)
    prefill = "panel_gemm" if panel_gemm_takes(model.q) else "int_kernel"
    assert model.q.kernels[:2] == ("int_kernel", "int_kernel")
    assert model.q.kernels[2] != "native" and model.q.kernels[3:] == (prefill,) * (len(BUCKETS) - 3)


def test_a_bucket_past_the_time_budget_takes_the_timed_groups_choice():
    """What most groups planned before chose at that bucket, among this group's candidates;
    the baseline where none did."""
    plans = {"a": ("native", "widened"), "b": ("native", "onednn"), "c": ("mv", "onednn")}
    assert inherited_kernel([BASELINE, "native", "widened"], 0, plans) == "native"
    assert inherited_kernel([BASELINE, "widened", "onednn"], 1, plans) == "onednn"
    assert inherited_kernel([BASELINE, "widened"], 1, plans) == "widened"
    assert inherited_kernel([BASELINE, "matmul_t"], 1, plans) == BASELINE
    assert inherited_kernel([BASELINE], 0, {}) == BASELINE


def test_the_time_budget_is_read_from_the_environment(monkeypatch):
    from models.kernels.linear_policy import PLAN_SECONDS, PLAN_SECONDS_ENV, plan_seconds

    monkeypatch.delenv(PLAN_SECONDS_ENV, raising=False)
    assert plan_seconds() == PLAN_SECONDS
    monkeypatch.setenv(PLAN_SECONDS_ENV, "60")
    assert plan_seconds() == 60.0
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv(PLAN_SECONDS_ENV, bad)
        with pytest.raises(ValueError, match=PLAN_SECONDS_ENV):
            plan_seconds()


def test_plan_past_its_time_budget_keeps_baselines_uncached(tmp_path):
    model = Tiny(torch.float32)
    cache = KernelCache(tmp_path / "k.json")
    choose_linear_kernels(model, torch.float32, cache, FakeTimer({"matmul_t": 0.1}), budget_s=-1)
    assert model.b.kernels == (BASELINE,) * len(BUCKETS) and not cache.entries
    assert model.q.kernels == ("int_kernel",) * len(BUCKETS)  # never a per-call dequantization


def test_quantized_layers_time_dequantizing_only_for_many_rows(tmp_path):
    model = Tiny(torch.float32)
    # our int8 kernel is a candidate too where it builds
    assert candidates(model.q, 1, torch.float32)[0] == "int_kernel"
    assert "dequantized" not in candidates(model.q, 1, torch.float32)
    assert "dequantized" in candidates(model.q, 4, torch.float32)
    # and our panel-dequantizing GEMM where it builds (AVX-512 BF16)
    ours = ["panel_gemm"] if panel_gemm_takes(model.q) else []
    tiled = ["native_rows", "native_gemm"] if model.q.mode == "int8" and "native" in candidates(
        model.q, 1, torch.float32) else []
    assert candidates(model.q, 128, torch.float32) == [
        "int_kernel"] + tiled + ["dequantized", "dequantized_t", "dequantized_bf16",
        "dequantized_t_bf16"] + ours
    assert candidates(model.q, 128, torch.bfloat16) == ["int_kernel"] + tiled + [
        "dequantized", "dequantized_t", "dequantized_f32", "dequantized_t_f32"] + ours
    choose_linear_kernels(model, torch.float32, KernelCache(tmp_path / "k.json"),
                 FakeTimer({"int_kernel": 1.0, "dequantized": 0.5, "dequantized_bf16": 0.6}))
    decode = "native" if "native" in candidates(model.q, 1, torch.float32) else "int_kernel"
    assert model.q.kernels == (decode,) + ("dequantized",) * (len(BUCKETS) - 1)


def test_a_tie_at_a_prefills_rows_keeps_our_quantized_gemm(tmp_path):
    """Its result is contiguous; another formulation must beat it by the margin."""
    model = Tiny(torch.bfloat16)
    if not panel_gemm_takes(model.q):
        pytest.skip("our quantized GEMM does not build here")
    choose_linear_kernels(model, torch.bfloat16, KernelCache(tmp_path / "k.json"),
                 FakeTimer({"int_kernel": 2.0, "dequantized": 1.0, "dequantized_t": 0.97,
                            "panel_gemm": 1.0, "native": 0.5}))
    # (ours is a candidate for a quantized weight up to 64 rows: there it wins at 0.5)
    assert model.q.kernels[2:] == ("native",) + ("panel_gemm",) * (len(BUCKETS) - 3)
    model = Tiny(torch.bfloat16)
    choose_linear_kernels(model, torch.bfloat16, KernelCache(tmp_path / "k2.json"),
                 FakeTimer({"int_kernel": 2.0, "dequantized": 1.0, "dequantized_t": 0.8,
                            "panel_gemm": 1.0, "native": 0.5}))
    assert model.q.kernels[2:] == ("native",) + ("dequantized_t",) * (len(BUCKETS) - 3)


def test_a_weight_of_several_tiles_is_dequantized_weight_first_only():
    """Over several tiles x W^T would copy each tile's columns into the output, which timing
    one tile's slice of the layer does not see: only (W x^T)^T is timed."""
    head = QuantizedLinear(torch.randn(4 * MIN_TILE_CHANNELS, TILE_BYTES // MIN_TILE_CHANNELS),
                           None, "int8")
    assert len(dequantization_tiles(head.out_features, head.in_features, torch.bfloat16)) > 1
    names = candidates(head, 128, torch.bfloat16)
    assert "dequantized_t" in names and "dequantized" not in names
    if native.load() is not None:  # tiles go through the reused buffer: decode rows too
        assert "dequantized_t" in candidates(head, 32, torch.bfloat16)


def test_onednn_choice_prepacks_and_matches(tmp_path):
    if "onednn" not in candidates(Linear(4, 4), 1, torch.float32):
        pytest.skip("no oneDNN in this build")
    model = Tiny(torch.float32)
    choose_linear_kernels(model, torch.float32, KernelCache(tmp_path / "k.json"),
                 FakeTimer({"onednn": 0.1}))
    layer = model.a[0]
    assert layer.kernels == ("onednn",) * len(BUCKETS) and layer.packed is not None
    x = torch.randn(5, 32)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


def test_pytorchs_int4_pack_only_for_groups_within_the_budget(tmp_path):
    """PyTorch's int4 kernel keeps a second pack of the weight: a group whose pack exceeds the
    budget (a tenth of the model's int4 bytes) never gets it as a candidate, even where it would
    time fastest, and keeps no such pack; a small group may."""
    model = nn.Module()
    model.experts = nn.ModuleList(QuantizedLinear(torch.randn(128, 256), None, "int4", 32)
                                  for _ in range(16))
    model.small = QuantizedLinear(torch.randn(64, 64), None, "int4", 32)
    assert "int_kernel" not in candidates(model.experts[0], 32, torch.float32, torch_int4=False)
    assert candidates(model.experts[0], 1, torch.float32, torch_int4=False)  # never empty
    choose_linear_kernels(model, torch.float32, KernelCache(tmp_path / "k.json"),
                 FakeTimer({"int_kernel": 0.01}))
    assert all("int_kernel" not in layer.kernels and layer.torch_packed is None
               for layer in model.experts)
    assert "int_kernel" in model.small.kernels


class ScatteredTimer(FakeTimer):
    """Like FakeTimer, but the named candidates' repeats disagree (a busy machine)."""

    def __init__(self, seconds: dict[str, float], scattered: set[str]) -> None:
        super().__init__(seconds)
        self.scattered = scattered

    def __call__(self, fns):
        self.calls += 1
        return {name: Timing((t, 3 * t, 3 * t) if name in self.scattered else (t,))
                for name, t in ((n, self.seconds.get(n, 1.0)) for n in fns)}


def test_unsettled_timings_are_used_and_timed_again_at_the_next_start(tmp_path):
    path = tmp_path / "k.json"
    model = Tiny(torch.float32)
    plans = choose_linear_kernels(model, torch.float32, KernelCache(path),
                         ScatteredTimer({"matmul_t": 0.5, "mv": 0.5}, {"matmul_t"}))
    assert plans["dense/float32/48x32"][1:] == ("matmul_t",) * (len(BUCKETS) - 1)
    saved = json.loads(path.read_text())["choices"]
    assert saved["dense/float32/48x32/65-256"]["settled"] is False
    assert saved["dense/float32/48x32/1"]["settled"] is True
    # The next start times the unsettled buckets again (and only them), settled this time.
    timer = FakeTimer({"mv": 0.5})
    plans = choose_linear_kernels(Tiny(torch.float32), torch.float32, KernelCache(path), timer)
    assert "matmul_t" not in plans["dense/float32/48x32"]
    assert plans["dense/float32/48x32"][3:] == (BASELINE,) * (len(BUCKETS) - 3)
    saved = json.loads(path.read_text())["choices"]
    assert all(entry["settled"] for entry in saved.values())
    unsettled_then = sum(name.startswith("dense/float32/") and name[-1] != "1"
                         for name in saved)
    assert timer.calls == 1 + unsettled_then  # the re-check, then each unsettled bucket


def test_an_entry_whose_repeats_never_agree_stands_after_two_timings(tmp_path):
    """A machine whose load scatters every timing: the second start times the unsettled
    buckets again, the third stands by what the second saved."""
    path = tmp_path / "k.json"
    choose_linear_kernels(Tiny(torch.float32), torch.float32, KernelCache(path),
                          ScatteredTimer({"matmul_t": 0.5, "mv": 0.5}, {"matmul_t"}))
    first = json.loads(path.read_text())["choices"]["dense/float32/48x32/65-256"]
    assert first["settled"] is False and first["timings"] == 1
    second_timer = ScatteredTimer({"matmul_t": 0.8, "mv": 0.5}, {"matmul_t"})
    choose_linear_kernels(Tiny(torch.float32), torch.float32, KernelCache(path), second_timer)
    second = json.loads(path.read_text())["choices"]["dense/float32/48x32/65-256"]
    assert second_timer.calls > 1 and second["timings"] == 2 and second["settled"] is False
    third_timer = ScatteredTimer({"matmul_t": 0.5, "mv": 0.5}, {"matmul_t"})
    model = Tiny(torch.float32)
    plans = choose_linear_kernels(model, torch.float32, KernelCache(path), third_timer)
    assert third_timer.calls <= 1  # at most the re-check of the saved plan
    assert plans["dense/float32/48x32"][3] == second["choice"]


def test_a_saved_plan_timed_on_a_busy_machine_is_timed_afresh(tmp_path):
    path = tmp_path / "k.json"
    choose_linear_kernels(Tiny(torch.float32), torch.float32, KernelCache(path),
                 FakeTimer({BASELINE: 10.0, "matmul_t": 10.0, "mv": 10.0, "native": 10.0,
                            "onednn": 10.0, "int_kernel": 10.0}))
    # Quiet now: the re-checked choice takes a fifth of its saved time, so every saved
    # choice of this model is forgotten and timed again.
    timer = FakeTimer({BASELINE: 2.0, "matmul_t": 1.0, "mv": 2.0, "native": 2.0,
                       "onednn": 2.0, "int_kernel": 2.0})
    model = Tiny(torch.float32)
    choose_linear_kernels(model, torch.float32, KernelCache(path), timer)
    assert model.a[0].kernels[1:] == ("matmul_t",) * (len(BUCKETS) - 1)
    assert timer.calls > len(BUCKETS)


def test_a_saved_plan_is_kept_on_a_busy_machine_and_new_timings_are_not_final(tmp_path):
    path = tmp_path / "k.json"
    choose_linear_kernels(Tiny(torch.float32), torch.float32, KernelCache(path),
                 FakeTimer({"mv": 0.5}))
    cache = KernelCache(path)
    cache.forget({k for k in cache.entries if k.startswith("int8/")})  # left to time now
    cache.save()
    model = Tiny(torch.float32)
    choose_linear_kernels(model, torch.float32, KernelCache(path), FakeTimer({"mv": 5.0}))
    saved = json.loads(path.read_text())["choices"]
    assert model.a[0].kernels[0] == "mv"  # kept
    assert saved["dense/float32/48x32/1"]["settled"] is True
    timed_now = [v for k, v in saved.items() if k.startswith("int8/") and len(v["seconds"]) > 1]
    assert timed_now and not any(v["settled"] for v in timed_now)


@pytest.mark.skipif(native.load() is None, reason="our kernels do not build here")
def test_our_kernel_timed_far_below_a_plain_read_is_not_final(tmp_path):
    """A busy process (another library's threads spinning) slowed our matrix-vector kernel
    to a tenth of its bandwidth: the plan uses what it measured but does not save it final."""
    holder = nn.Module()
    holder.big = Linear(2048, 2048, bias=False)  # 16 MiB: streamed from memory
    path = tmp_path / "k.json"
    streamed = 2048 * 2048 * 4
    timer = FakeTimer({"native": streamed / 1e9, BASELINE: streamed / 1e9})  # 1 GB/s each
    choose_linear_kernels(holder, torch.float32, KernelCache(path), timer, ruler=lambda: 20e9)
    saved = json.loads(path.read_text())["choices"]
    assert saved["dense/float32/2048x2048/1"]["settled"] is False
    # At a plain read's pace the same timing is final.
    choose_linear_kernels(holder, torch.float32, KernelCache(tmp_path / "k2.json"), timer,
                 ruler=lambda: 2e9)
    saved = json.loads((tmp_path / "k2.json").read_text())["choices"]
    assert saved["dense/float32/2048x2048/1"]["settled"] is True


def test_the_plan_logs_one_line_per_model(tmp_path, caplog):
    with caplog.at_level("DEBUG", logger="models.kernels"):
        choose_linear_kernels(Tiny(torch.float32), torch.float32, KernelCache(tmp_path / "k.json"),
                     FakeTimer({"matmul_t": 0.5}))
    info = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert len(info) == 1 and "planned" in info[0] and "choices:" in info[0]
    assert "timed" in info[0] and "matmul_t" in info[0]
    assert any(r.levelname == "DEBUG" and "linear kernel" in r.getMessage()
               for r in caplog.records)


def test_measure_stops_timing_a_candidate_far_slower_than_the_fastest(monkeypatch):
    """Each candidate is called once untimed, then timed; after the first timed round one
    three times the fastest or slower keeps that one sample, the others are timed every round."""
    from models.kernels import choice

    clock = [0.0]
    monkeypatch.setattr(choice.time, "perf_counter", lambda: clock[0])
    calls = {"fast": 0, "near": 0, "slow": 0}
    cost = {"fast": 1.0, "near": 2.5, "slow": 3.5}

    def candidate(name):
        def run():
            calls[name] += 1
            clock[0] += cost[name]
        return run

    timings = choice.measure({name: candidate(name) for name in cost}, rounds=5)
    assert calls == {"fast": 6, "near": 6, "slow": 2}  # a warm-up, then its timed calls
    assert timings["slow"].samples == (3.5,) and len(timings["near"].samples) == 5
    assert choice.pick({n: t.best for n, t in timings.items()}, "slow") == "fast"
