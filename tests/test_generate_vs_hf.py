"""Greedy generation through the whole engine is token-identical to transformers generate(),
under chunked prefill, prefix-cache hits and preemption, and batch-invariant in float32."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from tests.helpers import assert_released, greedy

GREEDY = greedy(24)


def _prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of exactly n tokens (EOS not special, like ignore_eos)."""
    never = hf.config.vocab_size  # an id no argmax can produce: generation never stops early
    ids = torch.tensor([prompt])
    with torch.no_grad():  # an explicit mask: without it, generate masks tokens equal to pad
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
            eos_token_id=never, pad_token_id=never,
        )
    assert out.shape[1] == len(prompt) + n
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def reference(qwen2_path, hf_models):
    """Prompts of different lengths and transformers' greedy continuations."""
    hf = hf_models(qwen2_path)
    prompts = _prompts(hf.config.vocab_size, [3, 17, 40, 64, 90, 9, 33, 50])
    return prompts, [_hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]


def _check(llm: LLM, prompts, expected) -> None:
    outs = llm.generate(prompts, GREEDY)
    for out, want in zip(outs, expected, strict=True):
        assert out.outputs[0].token_ids == want
        assert out.outputs[0].finish_reason == "length"
    assert_released(llm)


def test_batch_matches_transformers(qwen2_path, reference):
    _check(LLM(qwen2_path, max_model_len=256), *reference)


def test_chunked_prefill_matches(qwen2_path, reference):
    """A 16-token budget splits every prompt over several steps beside running decodes."""
    llm = LLM(qwen2_path, max_model_len=256, max_num_batched_tokens=16)
    _check(llm, *reference)
    assert llm.stats()["steps"] > sum(len(p) for p in reference[0]) // 16


def test_prefix_cache_hits_match(qwen2_path, reference):
    prompts, expected = reference
    llm = LLM(qwen2_path, max_model_len=256)
    _check(llm, prompts, expected)
    # The same prompts again: full blocks are shared, the rest of the last one is copied from
    # the first run's block (a tail); only the last token is computed.
    outs = llm.generate(prompts, GREEDY)
    for prompt, out, want in zip(prompts, outs, expected, strict=True):
        assert out.outputs[0].token_ids == want
        assert out.num_cached_tokens == len(prompt) - 1
    stats = llm.stats()
    assert stats["prefix_cache_tail_tokens"] == sum((len(p) - 1) % 16 for p in prompts) > 0


def test_a_second_turn_reuses_the_first_turns_tail(qwen2_path, hf_models, reference):
    """A second turn (the first prompt, its reply, new tokens) computes only what follows the
    first turn's KV: the partly filled blocks of its prompt and reply are copied, token by token,
    and its tokens are transformers' on the whole conversation."""
    hf = hf_models(qwen2_path)
    llm = LLM(qwen2_path, max_model_len=256)
    prompts, _ = reference
    firsts = llm.generate(prompts[:4], GREEDY)
    new = _prompts(hf.config.vocab_size, [5, 12, 1, 20], seed=1)
    seconds = [p + list(o.outputs[0].token_ids) + extra
               for p, o, extra in zip(prompts, firsts, new, strict=False)]
    before = llm.stats()["prefix_cache_tail_tokens"]
    outs = llm.generate(seconds, GREEDY)
    for prompt, out in zip(prompts, outs, strict=False):
        # The first turn's KV holds its prompt and all of its reply but the last token.
        assert out.num_cached_tokens == len(prompt) + GREEDY.max_tokens - 1
        assert out.outputs[0].token_ids == _hf_greedy(hf, out.prompt_token_ids,
                                                      GREEDY.max_tokens)
    assert llm.stats()["prefix_cache_tail_tokens"] > before
    assert_released(llm)


def test_shared_prefix_across_requests(qwen2_path, hf_models):
    hf = hf_models(qwen2_path)
    base = _prompts(hf.config.vocab_size, [48], seed=3)[0]
    prompts = [base + tail for tail in _prompts(hf.config.vocab_size, [5, 11, 2], seed=4)]
    llm = LLM(qwen2_path, max_model_len=256)
    llm.generate([base], GREEDY)
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.num_cached_tokens == 48
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, GREEDY.max_tokens)


def test_preemption_matches(qwen2_path, reference):
    """A KV cache of 10 blocks cannot hold 8 sequences: the newest are preempted, recomputed."""
    llm = LLM(qwen2_path, max_model_len=160, kv_cache_bytes=10 * 2 * 2 * 16 * 2 * 16 * 4)
    assert llm.engine.block_manager.num_blocks == 10
    outs = llm.generate(reference[0], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference[1]
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    llm.engine.check_integrity()


def test_preemption_with_chunking_and_no_prefix_cache(qwen2_path, reference):
    llm = LLM(
        qwen2_path, max_model_len=160, kv_cache_bytes=10 * 2 * 2 * 16 * 2 * 16 * 4,
        max_num_batched_tokens=24, enable_prefix_caching=False,
    )
    outs = llm.generate(reference[0], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference[1]


def test_llama_matches_transformers(llama_path, hf_models):
    hf = hf_models(llama_path)
    prompts = _prompts(hf.config.vocab_size, [12, 30, 47], seed=5)
    llm = LLM(llama_path, max_model_len=256, max_num_batched_tokens=32)
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, GREEDY.max_tokens)


def test_batch_invariance(qwen2_path, reference):
    """A request alone and inside a batch of 8 yields the same tokens (float32)."""
    prompts, _ = reference
    llm = LLM(qwen2_path, max_model_len=256, enable_prefix_caching=False)
    params = greedy(32)
    alone = llm.generate([prompts[3]], params)[0].outputs[0].token_ids
    batched = llm.generate(prompts, params)[3].outputs[0].token_ids
    assert alone == batched


def test_logprobs_match_transformers(qwen2_path, hf_models):
    hf = hf_models(qwen2_path)
    prompt = _prompts(hf.config.vocab_size, [21], seed=9)[0]
    llm = LLM(qwen2_path, max_model_len=256)
    params = greedy(6, logprobs=3)
    out = llm.generate([prompt], params)[0].outputs[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
    ref = logits.log_softmax(-1)[len(prompt) - 1 : -1]
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        assert list(entry)[0] == token
        assert len(entry) == 3  # the sampled token is also the top-1 under greedy
        top = ref[step].topk(3)
        assert list(entry) == top.indices.tolist()
        torch.testing.assert_close(
            torch.tensor(list(entry.values())), top.values, atol=1e-4, rtol=0
        )
