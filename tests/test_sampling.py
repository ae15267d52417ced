"""Sampling through the engine: seeds, filters, penalties, stop strings and stop tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from engine import LLM, SamplingParams
from engine.request import Request
from engine.sampler import SamplingBatch, _apply_repetition_penalty, sample


@pytest.fixture(scope="module")
def llm(qwen2_path):
    return LLM(qwen2_path, max_model_len=256)


PROMPT = [5, 17, 99, 3, 250, 41, 8]


def _tokens(llm, params, prompts=(PROMPT,)):
    return [o.outputs[0].token_ids for o in llm.generate([list(p) for p in prompts], params)]


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    alone = _tokens(llm, params)[0]
    assert _tokens(llm, params)[0] == alone
    others = [[1, 2, 3], [9] * 30, [4, 5]]
    mixed = llm.generate(
        [PROMPT] + others,
        [params] + [SamplingParams(max_tokens=20, temperature=0.8, ignore_eos=True)] * 3,
    )
    assert mixed[0].outputs[0].token_ids == alone
    other_seed = SamplingParams(max_tokens=20, temperature=1.0, seed=4321, ignore_eos=True)
    assert _tokens(llm, other_seed)[0] != alone


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = _tokens(llm, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    top_k = SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=1, ignore_eos=True)
    top_p = SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6, seed=2, ignore_eos=True)
    assert _tokens(llm, top_k)[0] == greedy
    assert _tokens(llm, top_p)[0] == greedy


def test_filters_keep_only_allowed_tokens():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(400, 1)

    def draw(params: SamplingParams) -> set[int]:
        reqs = [Request(str(i), [0], params, frozenset(), 1) for i in range(400)]
        batch = SamplingBatch.from_requests(reqs, 5, torch.device("cpu"))
        return set(sample(logits, batch).tokens.tolist())

    unfiltered = draw(SamplingParams())
    assert unfiltered == {0, 1, 2, 3, 4}
    assert draw(SamplingParams(top_k=2)) == {0, 1}
    assert draw(SamplingParams(min_p=0.3)) == {0, 1}  # p1/p0 = e^-1 = 0.37; p2/p0 = 0.14
    assert draw(SamplingParams(top_p=0.7)) == {0, 1}  # p0 = 0.64 < 0.7: the nucleus needs 1


def test_repetition_penalty_matches_transformers_processor():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0)) * 3
    req = Request("r", [3, 7, 7, 20], SamplingParams(repetition_penalty=1.3), frozenset(), 1)
    req.append_token(41)
    batch = SamplingBatch.from_requests([req], 50, torch.device("cpu"))
    ours = _apply_repetition_penalty(logits, batch.history, batch.penalty)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([req.all_token_ids]), logits.clone())
    torch.testing.assert_close(ours, ref)


def test_stop_string_ends_generation_and_is_not_emitted(llm):
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    full = llm.generate([PROMPT], greedy)[0].outputs[0]
    text = full.text
    assert len(text) > 12
    stop = text[5:9]
    out = llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.find(stop)]
    assert stop not in out.text


def test_stop_token_ends_generation(llm):
    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    full = llm.generate([PROMPT], greedy)[0].outputs[0].token_ids
    target = full[6]
    out = llm.generate([PROMPT], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True,
                                                stop_token_ids=[target]))[0].outputs[0]
    assert out.token_ids == full[: full.index(target) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_eos_stops_unless_ignored(llm):
    eos = llm.tokenizer.eos_token_id
    greedy = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    prompts = [[i, i + 1, i + 2] for i in range(40)]
    outs = llm.generate(prompts, greedy)
    hit = [(p, o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)
           if eos in o.outputs[0].token_ids]
    assert hit, "no prompt produced EOS; pick other prompts"
    prompt, ids = hit[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=60, temperature=0))[0].outputs[0]
    assert out.token_ids == ids[: ids.index(eos) + 1] and out.finish_reason == "stop"
    assert out.stop_reason is None


def test_max_tokens_is_capped_by_max_model_len(qwen2_path):
    llm = LLM(qwen2_path, max_model_len=40)
    out = llm.generate([list(range(1, 31))], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"seed": -1}, "seed"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 100}, "logprobs"),
        ({"temperature": float("nan")}, "temperature"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**kwargs)
