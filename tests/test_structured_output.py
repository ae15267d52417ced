"""Structured output, n > 1 and the new sampling options in the engine: the grammar mask against
a reference (and not touching unconstrained rows), outputs that always fit their schema, an
unconstrained request sharing the batch unchanged, grammar state released on finish, abort and
preemption and a preempted request resuming to the same output, refused constraints named;
penalties and logit_bias against their formulas; n completions from one prefill."""

from __future__ import annotations

import asyncio

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from engine import LLM, AsyncLLM, SamplingParams
from engine.request import Request
from engine.sampler import SamplingBatch, apply_bitmask, sample
from engine.structured_outputs import StructuredOutputs

HELLO = [{"role": "user", "content": "Describe the image in detail."}]


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")  # as OpenAI's strict schemas are

    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    tags: list[str] = Field(max_length=3)


PERSON = Person.model_json_schema()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 96, "temperature": 0, **kw})


@pytest.fixture(scope="module")
def llm(qwen2_path):
    return LLM(qwen2_path, max_model_len=512)


# ---- the sampler ------------------------------------------------------------------------


def test_bitmask_rules_out_forbidden_tokens_of_named_rows_only():
    torch.manual_seed(0)
    vocab, rows = 77, 5  # not a multiple of 32: the mask's last word is partly padding
    logits = torch.randn(rows, vocab)
    words = (vocab + 31) // 32
    mask = torch.randint(-(2**31), 2**31 - 1, (2, words), dtype=torch.int32)
    named = torch.tensor([3, 1])
    out = logits.clone()
    apply_bitmask(out, mask, named)
    for i, row in enumerate(named.tolist()):
        for token in range(vocab):
            allowed = (int(mask[i, token // 32]) >> (token % 32)) & 1
            want = logits[row, token] if allowed else float("-inf")
            assert out[row, token] == want
    for row in (0, 2, 4):
        assert torch.equal(out[row], logits[row])
    short = torch.full((1, 1), -1, dtype=torch.int32)  # covers 32 tokens: the rest forbidden
    out = logits.clone()
    apply_bitmask(out, short, torch.tensor([0]))
    assert torch.isinf(out[0, 32:]).all() and torch.equal(out[0, :32], logits[0, :32])


def _request(output: list[int], **params) -> Request:
    req = Request("r", [1, 2], SamplingParams(**params), frozenset(), 16)
    for t in output:
        req.append_token(t)
    return req


def test_presence_frequency_penalties_and_logit_bias_follow_their_formulas():
    vocab = 10
    logits = torch.randn(2, vocab)
    reqs = [_request([3, 3, 5], temperature=0, presence_penalty=0.5, frequency_penalty=0.25,
                     logit_bias={7: 4.0, 9: -100.0}),
            _request([3], temperature=0)]
    batch = SamplingBatch.from_requests(reqs, vocab, torch.device("cpu"))
    want = logits.clone()
    want[0, 3] -= 0.5 + 2 * 0.25
    want[0, 5] -= 0.5 + 0.25
    want[0, 7] += 4.0
    want[0, 9] -= 100.0
    out = sample(logits.clone(), batch)
    assert out.tokens.tolist() == want.argmax(-1).tolist()
    assert batch.bitmask is None  # nothing constrained: no mask work at all
    with pytest.raises(ValueError, match="presence_penalty"):
        SamplingParams(presence_penalty=3)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101})


# ---- outputs that fit -------------------------------------------------------------------


def test_outputs_fit_their_constraint_and_leave_unconstrained_neighbours_alone(llm):
    constrained = [
        greedy(structured_outputs=StructuredOutputs(json=PERSON)),
        SamplingParams(max_tokens=96, temperature=1.0, seed=7,
                       structured_outputs=StructuredOutputs(json=PERSON)),
        greedy(structured_outputs=StructuredOutputs(json_object=True), max_tokens=24),
        greedy(structured_outputs=StructuredOutputs(regex=r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)")),
        SamplingParams(max_tokens=8, temperature=1.0, seed=3,
                       structured_outputs=StructuredOutputs(choice=["yes", "no", "maybe"])),
    ]
    plain = greedy(max_tokens=12, ignore_eos=True)
    outs = llm.chat([HELLO] * 6, [*constrained, plain])
    for out in (*outs[:2], *outs[3:5]):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0]
    for out in outs[:2]:
        TypeAdapter(Person).validate_json(out.outputs[0].text)
    # Any object: a random model may add keys until max_tokens; it is an object so far.
    assert outs[2].outputs[0].text.startswith("{")
    assert "@" in outs[3].outputs[0].text
    assert outs[4].outputs[0].text in ("yes", "no", "maybe")
    alone = llm.chat(HELLO, plain)[0]
    assert alone.outputs[0].token_ids == outs[5].outputs[0].token_ids
    llm.engine.check_integrity()


def test_a_schema_the_compiler_refuses_is_named(llm):
    bad = StructuredOutputs(json={"type": "object", "properties": {"a": {"pattern": "["}}})
    with pytest.raises(ValueError, match="(?s)JSON schema cannot be compiled.*unclosed"):
        llm.chat(HELLO, greedy(structured_outputs=bad))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.chat(HELLO, greedy(logit_bias={10**6: 1.0}))


def test_grammar_state_is_released_and_rebuilt_across_preemption(llm, qwen2_path):
    """A KV cache too small for all: requests are preempted mid-reply, drop their matchers,
    and resume to the reply they give alone."""
    params = [SamplingParams(max_tokens=90, temperature=1.0, seed=i,
                             structured_outputs=StructuredOutputs(json=PERSON))
              for i in range(6)]
    want = [o.outputs[0].text for o in llm.chat([HELLO] * 6, params)]
    bs = llm.engine.block_manager.block_size
    tight = LLM(qwen2_path, max_model_len=8 * bs, kv_cache_bytes=_blocks(llm, 10))
    engine = tight.engine
    reqs = []
    for p in params:
        parsed = engine.processor.render_chat(HELLO)
        req = engine.make_request(engine.processor.process(parsed, {}), p)
        engine.add_request(req)
        reqs.append(req)
    held_while_waiting = False
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()  # a waiting (preempted) request holds no matcher
        held_while_waiting |= any(r.grammar.held for r in engine.scheduler.running)
    assert held_while_waiting and sum(r.metrics.num_preemptions for r in reqs) > 0
    assert [r.detokenizer.text for r in reqs] == want
    assert not any(r.grammar.held for r in reqs)  # finished: released


def _blocks(llm: LLM, n: int) -> int:
    return n * llm.engine.runner.layout.bytes_per_block


async def test_abort_releases_a_constrained_request_and_all_its_completions(qwen2_path):
    llm = AsyncLLM(qwen2_path, max_model_len=256)
    try:
        params = SamplingParams(max_tokens=200, temperature=1.0, n=3, ignore_eos=True,
                                structured_outputs=StructuredOutputs(regex="[a-z ]{1,400}"))
        stream = llm.chat(HELLO, params, request_id="abort-me")
        first = await anext(stream)
        assert len(first.outputs) == 3
        await llm.abort("abort-me")
        await stream.aclose()
        for _ in range(100):
            if not llm.engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        assert not llm.engine.has_unfinished() and not llm.engine.fanout.families
        assert llm.stats()["kv_blocks_used"] == 0
    finally:
        llm.shutdown()


# ---- n > 1 ------------------------------------------------------------------------------


def test_n_completions_share_one_prefill(llm):
    computed = []
    execute = llm.engine.runner.execute

    def counting(out):
        computed.extend(c.num_tokens for c in out.chunks if c.num_tokens > 1)
        return execute(out)

    llm.engine.runner.execute = counting
    long = [{"role": "user", "content": "The engine schedules requests, caches keys. " * 6}]
    try:
        out = llm.chat(long, SamplingParams(max_tokens=6, temperature=0, n=3))[0]
    finally:
        llm.engine.runner.execute = execute
    prompt = len(out.prompt_token_ids)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 1  # greedy: all alike
    assert sum(computed) < prompt + 2 * llm.engine.block_manager.block_size, computed
    seeded = SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=11, ignore_eos=True)
    a = llm.chat(HELLO, seeded)[0]
    b = llm.chat(HELLO, seeded)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    single = llm.chat(HELLO, SamplingParams(max_tokens=6, temperature=1.0, seed=11,
                                            ignore_eos=True))[0]
    assert single.outputs[0].token_ids == a.outputs[0].token_ids  # completion 0 = n=1's
    llm.engine.check_integrity()
