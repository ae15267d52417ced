"""Speculative decoding through the engine (engine/speculative/): output identical to plain
decoding, on the tiny dense models.

Drafts come from a scripted drafter that knows the plain run's output and is wrong on purpose
every fourth token (testing/speculative.py), so that every step verifies several drafts and both
acceptance and rejection run. At temperature 0 the tokens, texts, finish reasons and logprobs
are those of plain decoding, and every logits row both runs sample after the same tokens is
the same to the bit (verified rows sum as decodes of their tokens: float32 and bfloat16, dense,
int8 and int4 weights), in batches where some requests speculate and others do not; across
chunk cuts, preemption and prefix-cache hits the tokens are. Stop strings, EOS, max_tokens,
structured output, n > 1 and seeded sampling behave as without speculation; rejected drafts'
blocks go back and only accepted tokens enter the prefix cache. The n-gram drafter, a draft
model (refused by name when its tokenizer differs), the adaptive number of drafts and
speculative sampling's rule (its distribution, by a chi-square test on a small vocabulary) are
checked on their own.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.draft_verification import speculative_sample
from engine.encoder_cache import EncoderCacheManager
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler
from engine.speculation_costs import StepCosts
from engine.speculation_state import Proposal, SpeculationState, best_k
from engine.speculative.draft_model import DraftModelError
from engine.speculative.ngram import NgramIndex
from engine.speculative.speculator import Speculator
from engine.speculative_option import SpeculativeMethod
from engine.structured_outputs import StructuredOutputs
from models.kernels import native
from testing.speculative import run_parity
from tests.helpers import greedy
from ui.panels import engine_html

needs_native = pytest.mark.skipif(native.load() is None, reason="native kernels unavailable")
PROMPTS = [[5, 9, 200, 17, 3, 5, 9, 200, 17], list(range(40, 61)) * 2, [7, 7, 7]]


def _params(n: int = 16, **extra) -> SamplingParams:
    return greedy(n, **extra)


def _generate(llm, prompts=PROMPTS, per_prompt=None, **fields):
    """A `generate(overrides)` for run_parity: the prompts with params built from `fields`,
    `per_prompt` (one dict per prompt) merged in after the run's overrides."""
    def run(overrides):
        params = [SamplingParams(**{**fields, **overrides, **(per_prompt[i] if per_prompt
                                                              else {})})
                  for i in range(len(prompts))]
        return llm.generate(prompts, params)
    return run


# ---- through the engine ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def spec_llm(qwen2_path):
    """An engine that speculates (n-gram lookup), without prefix caching: two runs of the same
    prompts prefill alike."""
    return LLM(qwen2_path, speculative="ngram", max_model_len=256, block_size=4,
               enable_prefix_caching=False)


# 32 blocks of 4 tokens (2 layers x keys and values x 2 heads x 16 x float32 each): too few for
# the prompts of the chunk-cut test at once.
SMALL = dict(max_model_len=128, block_size=4, max_num_batched_tokens=12,
             kv_cache_bytes=32 * 2 * 2 * 4 * 2 * 16 * 4)


@pytest.fixture(scope="module")
def plain_llm(qwen2_path):
    """An engine without speculation, with a small KV cache and step budget."""
    return LLM(qwen2_path, **SMALL)


@needs_native
@pytest.mark.parametrize(("dtype", "quantization"), [("float32", None), ("bfloat16", "int4")])
def test_greedy_rows_equal_plain_decoding_to_the_bit(request, qwen2_path, dtype, quantization):
    """A batch in which two requests speculate and one does not (num_speculative_tokens=0)."""
    llm = request.getfixturevalue("spec_llm") if quantization is None else LLM(
        qwen2_path, speculative="ngram", dtype=dtype, quantization=quantization,
        quantization_group_size=32, max_model_len=256, block_size=4,
        enable_prefix_caching=False)
    run = _generate(llm, per_prompt=[{}, {"num_speculative_tokens": 0}, {}], max_tokens=24,
                    temperature=0.0, ignore_eos=True, logprobs=2)
    parity = run_parity(llm, run)
    parity.assert_identical()
    assert parity.speculative[1].metrics.draft_tokens == 0  # it did not speculate
    llm.engine.check_integrity()
    assert llm.engine.block_manager.num_used_blocks == 0


def test_tokens_equal_across_chunk_cuts_preemption_and_prefix_hits(qwen2_path, plain_llm):
    """Verifications share steps with chunked prefills (a budget of 12 tokens), the KV cache
    is too small for all requests (preemptions, each drafting again from scratch), and a second
    round of the same prompts hits the prefix cache (whole blocks, then a copied tail)."""
    prompts = PROMPTS + [list(range(100, 140)), PROMPTS[1][:30] + [3, 4]]
    plain_llm.engine.block_manager.reset_prefix_cache()
    want = [[o.outputs[0].token_ids for o in plain_llm.generate(prompts, _params(28))]
            for _ in range(2)]
    llm = LLM(qwen2_path, speculative="ngram", **SMALL)
    parity = run_parity(llm, _generate(llm, prompts, max_tokens=28, temperature=0.0,
                                       ignore_eos=True))
    assert [o.outputs[0].token_ids for o in parity.plain] == want[0]
    parity.assert_identical(bitwise=False)
    assert sum(o.metrics.num_preemptions for o in parity.speculative) > 0
    again = llm.generate(prompts, _params(28, speculative_method="ngram"))
    assert [o.outputs[0].token_ids for o in again] == want[1]
    assert sum(o.num_cached_tokens for o in again) > 0 and sum(
        o.metrics.accepted_tokens for o in again) > 0
    llm.engine.check_integrity()


def test_stops_eos_lengths_and_logprobs_as_plain_decoding(spec_llm):
    """Drafts run past a stop string, a stop token and max_tokens: the output ends where plain
    decoding's does, with its finish reason, stop reason, text and logprobs."""
    llm = spec_llm
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _params(12))]
    stops = [{"stop": [llm.tokenizer.decode(first[0][4:6])]},
             {"stop_token_ids": [first[1][5]]}, {"max_tokens": 7}]
    run = _generate(llm, per_prompt=stops, max_tokens=20, temperature=0.0, logprobs=3)
    parity = run_parity(llm, run, wrong_every=5)
    parity.assert_identical()
    reasons = [o.outputs[0].finish_reason for o in parity.speculative]
    assert reasons == ["stop", "stop", "length"]
    assert parity.speculative[1].outputs[0].stop_reason == first[1][5]


def test_structured_output_sees_only_accepted_tokens(spec_llm):
    """A regex constraint: each verified row's mask comes from the grammar advanced over the
    drafts before it (and back), so the output is plain decoding's; wrong drafts the grammar
    refuses are rejected by their row's mask."""
    llm = spec_llm
    constraint = StructuredOutputs(regex=r"[a-z ]{4,40}\.")
    run = _generate(llm, max_tokens=30, temperature=0.0, structured_outputs=constraint)
    parity = run_parity(llm, run, wrong_every=3)
    parity.assert_identical(bitwise=False)
    for out in parity.speculative:
        assert out.outputs[0].text.endswith(".") and out.outputs[0].finish_reason == "stop"


def test_seeded_sampling_and_n_completions_unchanged(spec_llm):
    """At temperature 0.9 with a seed, each kept draft is the target's own draw at its row
    (the draw plain decoding makes there): n = 2 completions come out as without speculation."""
    llm = spec_llm
    run = _generate(llm, max_tokens=20, temperature=0.9, top_p=0.95, seed=11, n=2,
                    ignore_eos=True)
    parity = run_parity(llm, run, wrong_every=4)
    assert all(len(o.outputs) == 2 for o in parity.speculative)
    parity.assert_identical(bitwise=False)


def test_ngram_drafter_is_lossless(qwen2_path):
    llm = LLM(qwen2_path, max_model_len=256, speculative="ngram")
    want = [o.outputs[0].token_ids for o in llm.generate(
        PROMPTS, _params(24, num_speculative_tokens=0))]
    outs = llm.generate(PROMPTS, _params(24))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics.draft_tokens for o in outs) > 0
    stats = llm.engine.stats()
    assert stats["speculative"] == "ngram"
    # the costs the number of drafts was chosen by, measured on this run's steps
    assert stats["verify_1_cost"] > 0 and stats["verify_4_cost"] > 0
    assert "a step verifying 1 / 4 drafts costs" in engine_html(stats)


def test_options_are_checked(spec_llm, plain_llm):
    for bad in ("eagle", "draft:", "ngram:4"):
        with pytest.raises(ValueError, match="speculative must be one of ngram, draft:PATH"):
            EngineConfig(speculative=bad)
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be in \[1, 16\]"):
        EngineConfig(num_speculative_tokens=17)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="needs an engine started with speculative"):
        plain_llm.generate([[1, 2]], SamplingParams(num_speculative_tokens=3))
    with pytest.raises(ValueError, match="speculative_method 'mtp' is not available"):
        spec_llm.generate([[1, 2]], SamplingParams(speculative_method="mtp"))


# ---- a draft model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    from testing.tiny import build_text_model

    return build_text_model(tmp_path_factory.mktemp("draft") / "qwen2", "qwen2", hidden_size=32,
                            num_layers=1, num_heads=2, num_kv_heads=1, seed=5)


def test_a_draft_model_is_lossless(qwen2_path, small_draft, spec_llm):
    """A small draft model, and the target as its own draft (every draft accepted, the costs
    held low so that the adaptive k asks for the most)."""
    want = [o.outputs[0].token_ids for o in spec_llm.generate(
        PROMPTS, _params(24, num_speculative_tokens=0))]
    llm = LLM(qwen2_path, max_model_len=256, block_size=4, speculative=f"draft:{small_draft}")
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _params(24))] == want
    own = LLM(qwen2_path, max_model_len=256, block_size=4, speculative=f"draft:{qwen2_path}")
    own.engine.speculator.costs.hold(0.08)
    outs = own.generate(PROMPTS, _params(24))
    assert [o.outputs[0].token_ids for o in outs] == want
    for o in outs:
        assert o.metrics.draft_tokens == o.metrics.accepted_tokens > 15
    # above temperature 0 the drafts are drawn from the draft's own distribution; the same
    # model's is the target's, so speculative sampling accepts every one
    sampled = own.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.8, seed=3,
                                                   ignore_eos=True))
    for o in sampled:
        assert o.metrics.draft_tokens == o.metrics.accepted_tokens > 15
    own.engine.check_integrity()


def test_a_draft_model_of_another_tokenizer_is_refused_by_name(qwen2_path, llama_path):
    with pytest.raises(DraftModelError, match=rf"draft model {llama_path} does not share the "
                       "target's tokenizer"):
        LLM(qwen2_path, max_model_len=64, speculative=f"draft:{llama_path}")


# ---- the pieces ------------------------------------------------------------------------------


def _linear(per_draft: float):
    return lambda k: 1.0 + per_draft * k


def test_the_number_of_drafts_follows_the_acceptance():
    assert best_k(0.95, 8, _linear(0.08)) == 8
    assert 2 <= best_k(0.7, 8, _linear(0.08)) <= 5
    # a costly drafter is asked for fewer
    assert best_k(0.7, 8, _linear(0.5)) < best_k(0.7, 8, _linear(0.08))
    # a draft kept 1 time in 20 costs more than it yields
    assert best_k(0.05, 8, _linear(0.08)) == 0
    state = SpeculationState("ngram", 6)
    for _ in range(8):
        state.record(5, 5)
    assert state.acceptance > 0.9 and state.next_k(_linear(0.08)) == 6
    for _ in range(40):
        state.record(3, 0)
    assert state.acceptance < 0.1
    asked = [state.next_k(_linear(0.08)) for _ in range(16)]
    assert asked.count(1) == 2 and asked.count(0) == 14  # a probe every 8 steps
    # drafts that would not pay even if all were accepted: no probe either
    assert [state.next_k(_linear(1.5)) for _ in range(16)] == [0] * 16
    assert state.asked == 0
    # ... once measured enough to believe it (until then, probes)
    assert [state.next_k(_linear(1.5), settled=False) for _ in range(16)].count(1) == 2


def test_the_cost_of_drafts_is_measured():
    """Step times by row count read as the cost of k drafts: between, past and before the
    counts measured; the prior until a plain step is; a plain step asked for when stale."""
    costs = StepCosts(prior_per_draft=0.25)
    cost = costs.cost(1, 8, "ngram", 0.0)
    assert cost(0) == 1.0 and cost(4) == pytest.approx(2.0)  # the prior: 1 + 4 * 0.25
    assert costs.needs_plain(1)
    costs.record_step(1, 0.100)
    costs.record_step(3, 0.200)  # 2 drafts: 0.05 s each
    assert not costs.needs_plain(1) and costs.needs_plain(2)
    cost = costs.cost(1, 8, "draft", 0.3)
    assert cost(1) == pytest.approx(1.5 + 0.3)  # between 1 and 3 rows, plus the prior draft
    assert cost(4) == pytest.approx(3.0 + 1.2)  # past 3 rows at the last two's slope
    costs.record_drafting("draft", 4, 0.040)  # 0.01 s a draft: 0.1 plain steps
    assert costs.cost(1, 8, "draft", 0.3)(4) == pytest.approx(3.0 + 0.4)
    # one count measured: the prior's slope on either side
    only = StepCosts(prior_per_draft=0.5)
    only.record_step(4, 0.2)
    assert only.step_seconds(2) == pytest.approx(0.1)
    assert only.step_seconds(6) == pytest.approx(0.4)
    # a decayed mean: a slower machine moves the estimate toward it
    for _ in range(20):
        costs.record_step(3, 0.400)
    assert 0.39 < costs.step_seconds(3) < 0.4
    assert costs.cost(1, 8, "ngram", 0.0)(2) > 3.9
    # fewer drafts once a verified row costs most of a plain step
    state = SpeculationState("ngram", 8)
    for _ in range(6):
        state.record(4, 2)
    assert state.next_k(costs.cost(1, 8, "ngram", 0.0)) == 0
    assert not costs.needs_plain(1)
    assert not costs.cost(1, 8, "ngram", 0.0).settled  # no step with one draft yet
    for _ in range(3):
        costs.record_step(2, 0.3)
    assert costs.cost(1, 8, "ngram", 0.0).settled
    assert costs.step_seconds(2) == pytest.approx(0.3)  # the plain mean of the first few
    for _ in range(11 - 3):  # 32 steps since: a plain step of one request measured again
        costs.record_step(3, 0.400)
    assert costs.needs_plain(1)
    costs.hold(0.08)
    assert not costs.needs_plain(1) and costs.cost(1, 8, "draft", 0.3)(5) == pytest.approx(1.4)
    with pytest.raises(ValueError, match="per_draft must be >= 0"):
        costs.hold(-1.0)


def test_ngram_index_finds_the_latest_continuation():
    tokens = [1, 2, 3, 4, 9, 9, 1, 2, 3, 5, 7, 1, 2, 3]
    index = NgramIndex()
    index.extend(tokens, len(tokens) - 1)
    assert index.lookup(tokens, 3) == (5, 7, 1)  # no draft before: the latest "1 2 3"
    assert index.lookup([*tokens, 8], 2) == ()
    media = NgramIndex(blocked=[(0, 5)])  # an image's placeholders are not looked up
    media.extend(tokens, len(tokens) - 1)
    assert media.lookup(tokens[:5] + [1, 2, 3, 4], 2) == ()


def test_ngram_index_copies_from_where_the_copy_reached():
    """Copying the prompt with an edit (its 4 made 9): after the edit, the common token 7
    resumes the copy at the prompt's place, not at 7's latest occurrence (the output's own)."""
    prompt = [1, 2, 7, 3, 4, 7, 5, 6, 7, 8]
    index = NgramIndex()

    def lookup(tokens):
        index.extend(tokens, len(tokens) - 1)
        return index.lookup(tokens, 3)

    assert lookup([*prompt, 1, 2]) == (7, 3, 4)  # "1 2" occurs once: the copy starts
    assert lookup([*prompt, 1, 2, 7, 3, 9]) == ()  # the edit: 9 occurs nowhere before
    assert lookup([*prompt, 1, 2, 7, 3, 9, 7]) == (5, 6, 7)  # after the prompt's second 7
    latest = NgramIndex()  # without a copy position: the latest 7, the output's own
    tokens = [*prompt, 1, 2, 7, 3, 9, 7]
    latest.extend(tokens, len(tokens) - 1)
    assert latest.lookup(tokens, 3) == (3, 9, 7)


def _request(rid: str, prompt: int, drafts: tuple[int, ...], max_tokens: int = 50) -> Request:
    req = Request(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens),
                  frozenset(), max_tokens, speculation=SpeculationState("ngram", 8))
    req.speculation.proposal = Proposal(drafts)
    return req


def _decoding(scheduler: Scheduler, reqs: list[Request]) -> None:
    for req in reqs:
        scheduler.add(req)
    out = scheduler.schedule()
    for chunk in out.chunks:
        chunk.req.append_token(7)
    scheduler.update_after_step(out)


def test_the_scheduler_fits_drafts_and_keeps_only_accepted_tokens():
    """Drafts cut by the rows of the step's decodes and verifications, the token budget and
    the tokens a request may still produce; after the step the request advances by its last
    token and the accepted drafts, gives back the blocks of rejected ones and registers only
    blocks of accepted tokens in the prefix cache; preemption drops its drafts."""
    config = EngineConfig(max_num_batched_tokens=14, max_num_seqs=4, block_size=2)
    blocks = BlockManager(60, 2, True)
    scheduler = Scheduler(config, blocks, EncoderCacheManager(16), verify_rows=8)
    a, b, c = (_request("a", 6, ()), _request("b", 3, ()), _request("c", 3, (), max_tokens=3))
    _decoding(scheduler, [a, b, c])  # prefill; each samples a token
    for req, drafts in ((a, (11, 12, 13, 14)), (b, (21, 22, 23)), (c, (31, 32, 33))):
        req.speculation.proposal = Proposal(drafts)
    out = scheduler.schedule()
    # 8 rows: 3 decodes, a's 4 drafts, the last row for b; c has none left
    assert {ch.req.request_id: ch.draft for ch in out.chunks} == {
        "a": (11, 12, 13, 14), "b": (21,), "c": ()}
    assert [ch.num_tokens for ch in out.chunks] == [5, 2, 1]
    start = a.num_computed_tokens
    assert len(a.block_ids) == blocks.blocks_needed(start + 5)
    out.chunks[0].accepted, out.chunks[1].accepted = (11,), (21,)
    for chunk in out.chunks:
        for token in (*chunk.accepted, 99):
            chunk.req.append_token(token)
    scheduler.update_after_step(out)
    assert a.num_computed_tokens == start + 2 == a.num_tokens - 1
    assert len(a.block_ids) == blocks.blocks_needed(a.num_tokens) < blocks.blocks_needed(start + 5)
    for req in (a, b, c):
        assert req.block_hashes == _chain(req.all_token_ids, 2)[:len(req.block_hashes)]
    hashes = {h for r in (a, b, c) for h in _chain(r.all_token_ids, 2)}
    assert set(blocks.cached) <= hashes
    scheduler.check_integrity()
    c.speculation.proposal = Proposal((31, 32, 33))  # c may produce 1 more token: no drafts
    a.speculation.proposal = Proposal((41, 42))
    budget = Scheduler(EngineConfig(max_num_batched_tokens=4, block_size=2), blocks,
                       EncoderCacheManager(16))
    budget.running = [a, b, c]
    out = budget.schedule()  # 4 tokens: a's, one draft, b's and c's
    assert [(ch.req.request_id, ch.draft) for ch in out.chunks] == [
        ("a", (41,)), ("b", ()), ("c", ())]
    budget._preempt(a, out)
    assert a.draft_token_ids == () and a.status is RequestStatus.PREEMPTED


def _chain(tokens: list[int], bs: int) -> list[bytes]:
    req = Request("x", list(tokens), SamplingParams(), frozenset(), 1)
    manager = BlockManager(1, bs, True)
    manager._extend_hashes(req, len(tokens) // bs)
    return req.block_hashes


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of Pearson's chi-square test of `counts` against `probs` (cells with expected
    counts below 5 merged)."""
    n = counts.sum().item()
    expected = probs * n
    keep = expected >= 5
    stat = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum().item()
    rest_e, rest_c = expected[~keep].sum().item(), counts[~keep].sum().item()
    cells = int(keep.sum())
    if rest_e > 0:
        stat += (rest_c - rest_e) ** 2 / rest_e
        cells += 1
    return float(torch.special.gammaincc(torch.tensor((cells - 1) / 2),
                                         torch.tensor(stat / 2)))


def test_speculative_sampling_keeps_the_target_distribution():
    """On a vocabulary of 6, drafts drawn from q: the first token emitted is distributed as
    p_0, and the second, after an accepted first draft, as p_1 (chi-square, p > 1e-3, 30k
    trials); a point-mass q is the coupled rule (accept d with probability p(d))."""
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 6, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(2, 6, generator=gen) * 1.5, dim=-1)
    trials = 30000
    torch.manual_seed(1)
    drafts = torch.stack([torch.multinomial(q[i], trials, replacement=True) for i in range(2)], 1)
    first, second = torch.zeros(6), torch.zeros(6)
    for t in range(trials):
        d = drafts[t].tolist()
        a, token = speculative_sample(p, q, d)
        first[d[0] if a else token] += 1
        if a >= 1:
            second[d[1] if a >= 2 else token] += 1
    assert _chi_square_p(first, p[0]) > 1e-3
    assert _chi_square_p(second, p[1]) > 1e-3
    # the first draft is kept with probability sum(min(p_0, q_0)); a point mass at d, p_0(d)
    accepted = second.sum().item() / trials
    assert math.isclose(accepted, torch.minimum(p[0], q[0]).sum().item(), abs_tol=0.015)
    point = torch.zeros(1, 6)
    point[0, 2] = 1.0
    kept = sum(speculative_sample(p, point, [2])[0] for _ in range(5000)) / 5000
    assert math.isclose(kept, p[0, 2].item(), abs_tol=0.03)


class _CountingDrafter:
    """Drafts token 7 k times; counts its rounds."""

    name = "ngram"
    cost_per_token = 0.0

    def __init__(self) -> None:
        self.rounds = 0

    def propose(self, reqs, ks):
        self.rounds += 1
        return [Proposal((7,) * k) for k in ks]

    def forget(self, req) -> None:
        pass

    def observe(self, out, result) -> None:
        pass


def test_a_drafters_cost_is_timed_on_rounds_that_continue():
    """The speculator times a drafter's round as the cost of its drafts only when each of its
    requests drafted the step before (a resumed request's round includes its catching up on
    every token since, a draft model's prefill); and a plain step is asked for while a plain
    step's time is unknown, unless a prompt's chunk will share the step."""
    drafter = _CountingDrafter()
    spec = Speculator(SpeculativeMethod.parse("ngram"), 4, drafter)
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=50), frozenset(), 50)
    req.status, req.num_computed_tokens = RequestStatus.RUNNING, 2
    req.speculation = spec.state_for(req.sampling_params)
    prompt = Request("p", list(range(1, 40)), SamplingParams(max_tokens=5), frozenset(), 5)
    prompt.status = RequestStatus.RUNNING  # mid-prompt: the next step is not decodes only
    spec.propose([req, prompt])  # so no plain step is asked for: the prior's drafts
    assert drafter.rounds == 1 and req.draft_token_ids
    req.speculation.asked = 0
    spec.propose([req])  # no plain step measured: none drafted
    assert drafter.rounds == 1 and req.draft_token_ids == ()
    spec.costs.record_step(1, 0.01)
    spec.propose([req])  # resumed: drafted, not timed
    assert drafter.rounds == 2 and req.draft_token_ids and "draft_cost_ngram" not in (
        spec.costs.report())
    spec.propose([req])  # continues: timed
    assert drafter.rounds == 3 and "draft_cost_ngram" in spec.costs.report()
