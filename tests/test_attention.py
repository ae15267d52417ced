"""Attention without padding across requests: sliding windows, soft-capping, bidirectional spans.

Windowed checkpoints are checked against transformers (logits and greedy tokens, chunked and
unchunked, with prefix-cache hits); soft-capping and bidirectional masks against attention
written out by hand; a step mixing a long chunk with many decodes against the same requests
run alone.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.encoder_cache import EncoderCacheManager
from engine.request import MultiModalFeature, PlaceholderRange, Request
from engine.sampling_params import SamplingParams as Params
from engine.scheduler import Scheduler
from models.layers.attention import LayerAttention, attend, paged_attention
from models.layers.attention_metadata import DECODE_PADDING, build_metadata
from tests.helpers import run_chunks

ATOL = 2e-4
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def windowed_paths(tmp_path_factory):
    """Qwen2 with `use_sliding_window` on its second layer only (windows differ per layer) and
    Mistral with a window on every layer; both windows far shorter than the prompts."""
    from testing.tiny import build_text_model

    root = tmp_path_factory.mktemp("windowed")
    qwen = build_text_model(
        root / "qwen2_sw", "qwen2", num_layers=2,
        config_overrides={"use_sliding_window": True, "sliding_window": 7, "max_window_layers": 1},
    )
    mistral = build_text_model(
        root / "mistral_sw", "mistral", num_layers=2, config_overrides={"sliding_window": 5},
    )
    return {"qwen2": qwen, "mistral": mistral}


@pytest.fixture(params=["qwen2", "mistral"])
def windowed(request, windowed_paths, hf_models):
    path = windowed_paths[request.param]
    hf = hf_models(path)
    assert hf.config.sliding_window is not None  # the reference really uses a window
    return path, hf


def test_windows_are_read_per_layer(windowed_paths):
    qwen = LLM(windowed_paths["qwen2"], max_model_len=256).engine.runner.model
    mistral = LLM(windowed_paths["mistral"], max_model_len=256).engine.runner.model
    assert [a.layout.sliding_window for a in qwen.attention_layers()] == [None, 7]
    assert [a.layout.sliding_window for a in mistral.attention_layers()] == [5, 5]


def test_sliding_window_logits_match_transformers(windowed):
    path, hf = windowed
    # 4-token blocks, so that windowed layers skip whole blocks.
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=256, block_size=4)
    model = llm.engine.runner.model
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, llm.engine.runner.vocab_size, (45,), generator=gen).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    blocks = [9, 2, 11, 0, 5, 7, 3, 13, 1, 8, 12, 6]  # deliberately non-contiguous
    (whole,) = run_chunks(model, [(ids, 0, 45, blocks)], block_size=4)
    torch.testing.assert_close(whole, ref, atol=ATOL, rtol=0)
    # Chunks that read earlier chunks from the cache, then decodes.
    got = []
    for start, end in [(0, 13), (13, 30), (30, 40)] + [(p, p + 1) for p in range(40, 45)]:
        got += run_chunks(model, [(ids, start, end, blocks)], block_size=4)
    torch.testing.assert_close(torch.cat(got), ref, atol=ATOL, rtol=0)


def test_sliding_window_greedy_with_chunks_and_prefix_hits(windowed):
    path, hf = windowed
    prompt = list(range(5, 60))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for batched in (2048, 16):  # unchunked, then 16-token chunks
        llm = LLM(path, max_model_len=256, max_num_batched_tokens=batched, block_size=8)
        first = llm.generate([{"prompt_token_ids": prompt}], params)[0]
        again = llm.generate([{"prompt_token_ids": prompt}], params)[0]  # prefix-cache hit
        assert first.outputs[0].token_ids == ref
        assert again.num_cached_tokens >= 48
        assert again.outputs[0].token_ids == ref


def _reference(q, k, v, visible, scale, softcap=None):
    """Attention written out: q [Lq, H, D], k/v [Lk, Hkv, D], visible [Lq, Lk] bool."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


def _cache(num_blocks=8, block_size=4, heads=2, dim=8):
    return torch.zeros(2, heads, num_blocks, block_size, dim)


def test_softcap_matches_reference_in_chunks_and_decodes():
    gen = torch.Generator().manual_seed(0)
    n, heads, kv_heads, dim, cap = 11, 4, 2, 8, 2.5
    q = torch.randn(n, heads, dim, generator=gen) * 3  # large scores, so the cap matters
    k = torch.randn(n, kv_heads, dim, generator=gen) * 3
    v = torch.randn(n, kv_heads, dim, generator=gen)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    ref = _reference(q, k, v, causal, 0.3, softcap=cap)
    assert not torch.allclose(ref, _reference(q, k, v, causal, 0.3))
    layer = LayerAttention(softcap=cap)
    cache, table = _cache(), [3, 0, 6]
    got = []
    for start, end in [(0, 6), (6, 9), (9, 10), (10, 11)]:
        meta = build_metadata([start], [end - start], [table], 4, CPU)
        got.append(paged_attention(q[start:end], k[start:end], v[start:end], cache, meta, 0.3,
                                   layer))
    torch.testing.assert_close(torch.cat(got), ref, atol=1e-5, rtol=0)


def test_attend_softcap_causal_without_mask():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=gen) for _ in range(3))
    got = attend(q, k, v, None, True, 0.5, softcap=1.0)
    visible = torch.ones(5, 5, dtype=torch.bool).tril()
    ref = _reference(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), visible,
                     0.5, softcap=1.0)
    torch.testing.assert_close(got[0].transpose(0, 1).reshape(5, -1), ref, atol=1e-6, rtol=0)


def test_bidirectional_span_mask_matches_hand_written():
    # A 12-token chunk after 4 cached tokens; a span at [7, 11) is attended both ways.
    meta = build_metadata([4], [12], [[0, 1, 2, 3]], 4, CPU, bidirectional=[[(7, 11)]])
    (group,) = meta.groups
    mask = group.views[None].mask[0, 0]  # [12 queries, 16 keys]
    expected = torch.zeros(12, 16, dtype=torch.bool)
    for i in range(12):
        row = 4 + i
        for key in range(16):
            expected[i, key] = key <= row or (7 <= row < 11 and 7 <= key < 11)
    assert torch.equal(mask == 0, expected)
    # Row 7 (the span's first token) sees the whole span, row 11 (after it) is causal again.
    assert (mask[3, 7:11] == 0).all() and (mask[3, 11:] < 0).all()
    assert (mask[7, 12:] < 0).all()


def test_bidirectional_span_with_window_and_attention_output():
    gen = torch.Generator().manual_seed(2)
    n, spans, window = 10, [(2, 7)], 3
    q = torch.randn(n, 2, 8, generator=gen)
    k = torch.randn(n, 2, 8, generator=gen)
    v = torch.randn(n, 2, 8, generator=gen)
    visible = torch.zeros(n, n, dtype=torch.bool)
    for r in range(n):
        for c in range(n):
            # transformers' Gemma 3 rule: AND(window, OR(causal, same span))
            visible[r, c] = (c <= r or (2 <= r < 7 and 2 <= c < 7)) and r - c < window
    meta = build_metadata([0], [n], [[0, 1, 2]], 4, CPU, windows=(None, window),
                          bidirectional=[spans])
    out = paged_attention(q, k, v, _cache(), meta, 0.35, LayerAttention(window))
    torch.testing.assert_close(out, _reference(q, k, v, visible, 0.35), atol=1e-5, rtol=0)


def test_a_span_outside_its_chunk_is_a_bug():
    with pytest.raises(ValueError, match="not inside chunk"):
        build_metadata([0], [8], [[0, 1]], 4, CPU, bidirectional=[[(6, 10)]])


def _scheduler(budget: int) -> Scheduler:
    config = EngineConfig(max_num_batched_tokens=budget, max_num_seqs=4,
                          max_num_encoder_input_tokens=4096, encoder_cache_size=4096)
    return Scheduler(config, BlockManager(64, 4, True), EncoderCacheManager(4096))


def _request(rid: str, n: int, spans: list[tuple[int, int]], bidirectional=True) -> Request:
    req = Request(rid, list(range(n)), Params(max_tokens=4), frozenset(), 4)
    req.mm_features = [
        MultiModalFeature("image", f"{rid}-{i}", PlaceholderRange(lo, hi - lo,
                                                                   bidirectional=bidirectional))
        for i, (lo, hi) in enumerate(spans)
    ]
    return req


def test_scheduler_never_cuts_a_bidirectional_span():
    sched = _scheduler(budget=20)
    req = _request("a", 60, [(12, 28), (40, 45)])
    sched.add(req)
    cuts = []
    while req.num_computed_tokens < req.num_tokens:
        out = sched.schedule()
        (chunk,) = out.chunks
        cuts.append((chunk.start, chunk.end))
        sched.update_after_step(out)
    assert cuts == [(0, 12), (12, 32), (32, 52), (52, 60)]
    for lo, hi in [(12, 28), (40, 45)]:
        assert any(s <= lo and hi <= e for s, e in cuts)
    # A causal span of the same shape is cut wherever the budget ends.
    sched = _scheduler(budget=20)
    causal = _request("b", 60, [(12, 28)], bidirectional=False)
    sched.add(causal)
    assert sched.schedule().chunks[0].end == 20


def test_startup_refuses_a_budget_smaller_than_the_largest_span():
    from engine.budgets import check_bidirectional_budget

    with pytest.raises(ValueError, match="up to 300 tokens.*max_num_batched_tokens is 256"):
        check_bidirectional_budget(EngineConfig(max_num_batched_tokens=256), 300)
    check_bidirectional_budget(EngineConfig(max_num_batched_tokens=256), 256)


def test_decodes_are_bucketed_by_context_and_masks_stay_small():
    # One 512-token chunk beside 32 decodes: masks are the chunk's own [q, context] plus each
    # decode bucket's [B, L]; nothing grows as batch x longest chunk x context.
    contexts = [100] * 16 + [3000] * 16
    starts = [512] + [c - 1 for c in contexts]
    lens = [512] + [1] * 32
    tables = [list(range(64))] + [list(range(200))] * 32
    meta = build_metadata(starts, lens, tables, 16, CPU)
    chunk, *decodes = meta.groups
    assert chunk.q_len == 512 and chunk.num_seqs == 1
    assert len(decodes) == 2  # the short contexts are not all padded to 3000
    decode_bytes = 0
    for group in decodes:
        members = [contexts[r - 512] for r in group.rows.tolist()]
        width = group.views[None].mask.shape[-1]
        assert width == -(-max(members) // 16) * 16
        assert len(members) * max(members) <= DECODE_PADDING * sum(members)
        decode_bytes += len(members) * width * 4
    assert meta.mask_bytes() == 512 * 1024 * 4 + decode_bytes


def test_long_chunk_beside_many_decodes_gives_the_tokens_each_gets_alone(qwen2_path):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3 + i, 12 + 3 * i))} for i in range(12)]
    long_prompt = {"prompt_token_ids": [(7 * i) % 500 + 3 for i in range(300)]}
    alone = LLM(qwen2_path, max_model_len=512, enable_prefix_caching=False)
    expected = [alone.generate([p], params)[0].outputs[0].token_ids
                for p in [*prompts, long_prompt]]
    llm = LLM(qwen2_path, max_model_len=512, enable_prefix_caching=False,
              max_num_batched_tokens=140)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(engine.make_request(_process(engine, p), params, f"s{i}"))
    engine.step()  # the short prompts prefill; from now on they decode
    engine.add_request(engine.make_request(_process(engine, long_prompt), params, "L"))
    mixed = 0
    done = {}
    while engine.has_unfinished():
        out = engine.scheduler.schedule()
        lens = sorted(c.num_tokens for c in out.chunks)
        mixed += lens[-1] > 1 and lens[0] == 1
        result = engine.runner.execute(out)
        engine.scheduler.update_after_step(out)
        for o in engine._postprocess(out, result, 0.0):
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert mixed >= 2  # the long prompt's chunks really shared steps with decodes
    assert [done[f"s{i}"] for i in range(12)] + [done["L"]] == expected


def _process(engine, prompt):
    return engine.processor.process(engine.processor.parse(prompt), {})


@pytest.mark.parametrize("kernel", ["sdpa", "matmul"])
@pytest.mark.parametrize("window", [None, 6])
def test_decode_kernels_match_reference_in_a_mixed_step(kernel, window):
    """Decodes at different contexts (two buckets) beside a chunk, for both decode kernels."""
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, bs = 4, 2, 8, 4
    cache = _cache(num_blocks=40, block_size=bs, heads=kv_heads, dim=dim)
    contexts = [3, 9, 30, 31]
    seqs = [torch.randn(c, 3, kv_heads, dim, generator=gen) for c in contexts]  # q, k, v
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(4)]
    for (c, seq, table) in zip(contexts, seqs, tables, strict=True):  # prefill all but one
        meta = build_metadata([0], [c - 1], [table], bs, CPU, windows=(None, window))
        paged_attention(seq[:-1, 0].repeat_interleave(2, 1), seq[:-1, 1], seq[:-1, 2], cache,
                        meta, 0.3, LayerAttention(window))
    chunk_q = torch.randn(7, heads, dim, generator=gen)
    chunk_kv = torch.randn(7, 2, kv_heads, dim, generator=gen)
    meta = build_metadata([c - 1 for c in contexts] + [0], [1, 1, 1, 1, 7],
                          tables + [[32, 33]], bs, CPU, windows=(None, window),
                          decode_kernel=kernel)
    assert len(meta.groups) == 4  # the chunk; decodes bucketed as {31, 30}, {9}, {3}
    q = torch.cat([s[-1:, 0].repeat_interleave(2, 1) for s in seqs] + [chunk_q])
    k = torch.cat([s[-1:, 1] for s in seqs] + [chunk_kv[:, 0]])
    v = torch.cat([s[-1:, 2] for s in seqs] + [chunk_kv[:, 1]])
    out = paged_attention(q, k, v, cache, meta, 0.3, LayerAttention(window))
    for i, (c, seq) in enumerate(zip(contexts, seqs, strict=True)):
        key = torch.arange(c)
        visible = (key <= c - 1) & ((c - 1 - key < window) if window else True)
        ref = _reference(seq[-1:, 0].repeat_interleave(2, 1), seq[:, 1], seq[:, 2],
                         visible[None], 0.3)
        torch.testing.assert_close(out[i : i + 1], ref, atol=1e-5, rtol=0)
    rows, cols = torch.arange(7)[:, None], torch.arange(7)[None, :]
    visible = (cols <= rows) & ((rows - cols < window) if window else True)
    ref = _reference(chunk_q, chunk_kv[:, 0], chunk_kv[:, 1], visible, 0.3)
    torch.testing.assert_close(out[4:], ref, atol=1e-5, rtol=0)


def test_the_decode_kernel_choice_is_kept_for_the_next_start(tmp_path, monkeypatch):
    """Timed once: a later process (the in-memory choices gone) reads it from the plan's
    cache file instead of timing again."""
    from models.kernels.choice import KernelCache
    from models.layers import decode_attention_choice as choice

    timed = []
    real = choice._time_decode_kernels
    monkeypatch.setattr(choice, "_time_decode_kernels",
                        lambda *args: timed.append(1) or real(*args))
    monkeypatch.setattr(choice, "_CHOICES", {})
    path = tmp_path / "plan.json"
    first = choice.choose_decode_attention(2, 1, 8, torch.float32, CPU, 4,
                                           cache=KernelCache(path))
    monkeypatch.setattr(choice, "_CHOICES", {})
    again = choice.choose_decode_attention(2, 1, 8, torch.float32, CPU, 4,
                                           cache=KernelCache(path))
    assert first == again and len(timed) == 1
    monkeypatch.setattr(choice, "_CHOICES", {})  # another shape is timed
    choice.choose_decode_attention(2, 1, 16, torch.float32, CPU, 4, cache=KernelCache(path))
    assert len(timed) == 2


def test_decode_kernel_is_chosen_by_measurement():
    from models.layers.attention_metadata import KERNELS
    from models.layers.decode_attention_choice import choose_decode_attention

    assert choose_decode_attention(4, 2, 8, torch.float32, CPU) in KERNELS
    assert choose_decode_attention(4, 2, 8, torch.float32, torch.device("cuda")) == "sdpa"
    with pytest.raises(ValueError, match="decode_kernel"):
        build_metadata([0], [2], [[0]], 4, CPU, decode_kernel="fast")


def _flash_attn_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal,
                         window_size, softcap):
    """flash-attn's documented varlen semantics, written out: per sequence, query i of n sees
    key j of m when j <= i + m - n (causal, bottom-right) and (i + m - n) - j <= left."""
    out = []
    for b in range(len(cu_q) - 1):
        qs, ks, vs = q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]]
        n, m = qs.shape[0], ks.shape[0]
        rows, cols = torch.arange(n)[:, None] + m - n, torch.arange(m)[None, :]
        visible = cols <= rows
        if window_size[0] >= 0:
            visible &= rows - cols <= window_size[0]
        out.append(_reference(qs, ks, vs, visible, softmax_scale, softcap or None))
    return torch.cat(out).view(q.shape)


@pytest.mark.parametrize("window, softcap", [(None, None), (5, 2.0)])
def test_varlen_backend_indices_match_the_sdpa_path(monkeypatch, window, softcap):
    """The flash-attn backend's host-built indices (rows, cumulative lengths, context slots),
    run through a stand-in with flash-attn's documented semantics, give the SDPA path's output;
    a chunk with a bidirectional span stays on SDPA. (The real kernel: tests/test_cuda.py.)"""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(
        flash_attn_varlen_func=_flash_attn_stand_in))
    gen = torch.Generator().manual_seed(7)
    starts, lens = [0, 6, 13, 0], [9, 1, 1, 7]
    tables = [[0, 1, 2], [3, 4], [5, 6, 7, 8], [9, 10]]
    spans = [[], [], [], [(2, 5)]]
    q = torch.randn(18, 4, 8, generator=gen)
    k, v = torch.randn(18, 2, 8, generator=gen), torch.randn(18, 2, 8, generator=gen)
    layer = LayerAttention(window, softcap)
    outs = {}
    for backend in ("sdpa", "flash_attn"):
        cache = torch.randn(2, 2, 12, 4, 8, generator=torch.Generator().manual_seed(3))
        meta = build_metadata(starts, lens, tables, 4, CPU, windows=(None, window),
                              bidirectional=spans, backend=backend)
        if backend == "flash_attn":
            assert meta.varlen.rows.tolist() == list(range(11))  # the span chunk is not in it
            assert [g.num_seqs for g in meta.groups] == [1]
        outs[backend] = paged_attention(q, k, v, cache, meta, 0.3, layer)
    torch.testing.assert_close(outs["flash_attn"], outs["sdpa"], atol=1e-5, rtol=0)
