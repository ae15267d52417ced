"""KV pools reserved, not written: resident memory follows use, and slots never written (NaN
here) do not reach attention through the padded gathers of the SDPA paths."""

from __future__ import annotations

import math
import os

import pytest
import torch

from engine import LLM, SamplingParams

MIB = 1 << 20
PREFIX = list(range(3, 40))  # shared: the second round hits the prefix cache, tails copied
PROMPTS = [PREFIX + list(range(50, 50 + n)) for n in (2, 11, 25)]
PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)


def _engine(path, monkeypatch, kernel: str, fill: float | None) -> LLM:
    import engine.kv_pool as pools
    import engine.runner_setup as runner

    if fill is not None:
        monkeypatch.setattr(pools, "pool", lambda shape, dtype, device: torch.full(
            shape, fill, dtype=dtype, device=device))
    monkeypatch.setattr(runner, "choose_decode_attention", lambda *args, **kwargs: kernel)
    # 128 MiB per layer's pool: past glibc's mmap threshold, so its pages are fresh
    return LLM(path, dtype="float32", max_model_len=512, max_num_seqs=4,
               kv_cache_bytes=256 * MIB)


def _run(llm: LLM) -> tuple[list[list[int]], list[list[float]]]:
    tokens, logprobs = [], []
    for _ in range(2):
        for out in llm.generate(PROMPTS, PARAMS):
            c = out.outputs[0]
            tokens.append(list(c.token_ids))
            logprobs.append([lp[t] for t, lp in zip(c.token_ids, c.logprobs, strict=True)])
    return tokens, logprobs


@pytest.fixture(scope="module")
def reference(qwen2_path):
    """The engine as it starts (torch.empty pools), and its outputs and resident KV bytes at
    start, after a short request and after a long one."""
    with pytest.MonkeyPatch.context() as mp:
        llm = _engine(qwen2_path, mp, "sdpa", None)
        resident = [llm.stats()["kv_resident_bytes"]]
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
        resident.append(llm.stats()["kv_resident_bytes"])
        llm.generate([list(range(3, 450))], SamplingParams(max_tokens=2, ignore_eos=True))
        resident.append(llm.stats()["kv_resident_bytes"])
        stats = llm.stats()
        return _run(llm), resident, stats


def test_resident_kv_memory_grows_with_use_not_the_budget(reference):
    _, (start, short, long), stats = reference
    assert stats["kv_reserved_bytes"] >= 255 * MIB
    # nothing zero-filled: at start only the first page of each layer's pool (glibc's header
    # of an mmap'd allocation sits there; block 0, where block tables are padded, is never
    # written either), then the short request's block per layer. One page more than the two
    # headers was seen once in a full CI run (not reproduced alone; cause unknown): allowed,
    # since a block written at start-up would show 4 pages per layer (its keys and values of
    # each head lie in separate pages) and a zero-filled pool 128 MiB.
    assert start <= 3 * os.sysconf("SC_PAGE_SIZE") and start < short < MIB, (start, short)
    # the long request's 449 tokens: 29 blocks (the short one's freed block may be among them)
    assert 29 <= stats["kv_blocks_first_used"] <= 30, stats
    # 447 tokens: 28 blocks of 2 layers x 2 x 2 heads x 16 x 16 x 4 bytes
    assert long - short >= 28 * 8192 * 0.9, (start, short, long)
    assert long < 4 * MIB


@pytest.mark.parametrize("kernel", ["sdpa", "matmul"])
def test_unwritten_slots_never_reach_attention(qwen2_path, monkeypatch, reference, kernel):
    (tokens, logprobs), _, _ = reference
    got_tokens, got_logprobs = _run(_engine(qwen2_path, monkeypatch, kernel, math.nan))
    assert got_tokens == tokens
    flat = [v for row in got_logprobs for v in row]
    assert all(math.isfinite(v) for v in flat)
    assert max(abs(a - b) for a, b in zip(flat, [v for row in logprobs for v in row],
                                          strict=True)) < 1e-3


def test_a_hybrid_model_with_unwritten_pools_matches_transformers(tmp_path, hf_models,
                                                                  monkeypatch):
    """Qwen3.5 (linear-attention layers and a full-attention layer): KV and state pools full
    of NaN at start, a chunked prefill, a decode, a prefix hit restoring a snapshot."""
    import engine.kv_pool as pools
    import engine.memory_plan as plan
    from testing.qwen3_5 import build_qwen3_5_text_model
    from tests.helpers import assert_matches_reference, hf_greedy

    nan = lambda shape, dtype, device: torch.full(shape, math.nan, dtype=dtype, device=device)  # noqa: E731
    monkeypatch.setattr(pools, "pool", nan)
    monkeypatch.setattr(plan, "state_pool", nan)
    path = build_qwen3_5_text_model(tmp_path / "m")
    hf = hf_models(path)
    llm = LLM(path, max_model_len=512, max_num_batched_tokens=5)
    prompt = llm.engine.tokenizer.encode("Once upon a time, in a land far away, there lived")
    ids = torch.tensor([prompt])
    want = hf_greedy(hf, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                     len(prompt), 6)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    assert_matches_reference(llm.generate([prompt], greedy)[0], *want, "chunked")
    again = llm.generate([prompt], greedy)[0]
    assert again.num_cached_tokens > 0
    assert_matches_reference(again, *want, "prefix hit")
