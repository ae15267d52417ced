"""The engine's side of speculative decoding: the drafters an engine started with `speculative`
holds (its configured one, and n-gram lookup, which any request may choose), each request's
speculation state, and after every step the drafts for the next.

Each step, for every running request that speculates and decodes next (its last token is the
only one not computed), the request's number of drafts is chosen from its measured acceptance
(engine/speculation_state.py) and what drafts cost on this machine, measured on the engine's
own steps (engine/speculation_costs.py), and its drafter asked for that many. Drafters see the
step that just ran (`after_step`): a drafter that keeps state per request (a draft model's
cache, the MTP layer's) catches up on the tokens the step accepted there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from engine.block_manager import BlockManager
from engine.checkpoint_setup import CheckpointSetup
from engine.config import EngineConfig
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.scheduler import ScheduledChunk, SchedulerOutput
from engine.speculation_costs import CostOfDrafts, StepCosts
from engine.speculation_state import Proposal, SpeculationState
from engine.speculative.ngram import NgramProposer
from engine.speculative_option import SpeculativeMethod

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner, StepResult


class Proposer(Protocol):
    """A drafter: proposes up to k tokens per request."""

    name: str
    cost_per_token: float  # drafting one token, in plain decode steps, until measured

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[Proposal | None]:
        """Drafts for each request (None: no draft), at most ks[i] tokens each."""
        ...

    def forget(self, req: Request) -> None:
        """`req` finished or was preempted: drop what is kept for it."""
        ...

    def observe(self, out: SchedulerOutput, result: StepResult) -> None:
        """The step that ran (its chunks, their new tokens and the decoder's output)."""
        ...


class Speculator:
    """The drafters and the per-request speculation of one engine."""

    def __init__(self, method: SpeculativeMethod, cap: int, drafter: Proposer) -> None:
        self.method, self.cap = method, cap
        self.drafters: dict[str, Proposer] = {"ngram": NgramProposer()}
        self.drafters[method.name] = drafter
        self.draft_rounds = 0
        self.draft_seconds = 0.0
        self.drafted = 0  # draft tokens verified, all requests
        self.accepted = 0
        self.costs = StepCosts()

    def state_for(self, params: SamplingParams) -> SpeculationState | None:
        """A new request's speculation (None: it does not speculate). Asking for a drafter
        the engine does not have is a SamplingParamsError naming the ones it has."""
        cap = self.cap if params.num_speculative_tokens is None else min(
            params.num_speculative_tokens, self.cap)
        name = params.speculative_method or self.method.name
        if name not in self.drafters:
            raise SamplingParamsError("speculative_method", (
                f"speculative_method {name!r} is not available on this engine (it drafts with "
                f"{', '.join(self.drafters)})"))
        return SpeculationState(name, cap) if cap else None

    def propose(self, running: Sequence[Request]) -> None:
        """Drafts for the next step of every running request that speculates and decodes."""
        t0 = time.monotonic()
        decoding = [req for req in running if req.status is RequestStatus.RUNNING
                    and req.num_tokens - req.num_computed_tokens == 1]
        # a plain step to measure, where the next step can be one of decodes only (a prompt
        # chunk beside them would keep it from being measured)
        plain = len(decoding) == len(running) and self.costs.needs_plain(len(decoding))
        by_drafter: dict[str, list[tuple[Request, int]]] = {}
        resumed: set[str] = set()  # drafters with a request that did not draft last step
        costs: dict[tuple[str, int], CostOfDrafts] = {}  # one reading per drafter and cap
        for req in decoding:
            spec = req.speculation
            if spec is None:
                continue
            spec.proposal = None
            drafted_last = spec.asked > 0
            if plain:
                spec.asked = 0
                continue
            cost = costs.get((spec.method, spec.cap))
            if cost is None:
                cost = costs[spec.method, spec.cap] = self.costs.cost(
                    len(decoding), spec.cap, spec.method, self.drafters[spec.method].cost_per_token)
            k = min(spec.next_k(cost, cost.settled), req.max_tokens - req.num_output_tokens - 1)
            if k > 0:
                by_drafter.setdefault(spec.method, []).append((req, k))
                if not drafted_last:
                    resumed.add(spec.method)
        for name, items in by_drafter.items():
            reqs = [r for r, _ in items]
            t_draft = time.monotonic()
            proposals = self.drafters[name].propose(reqs, [k for _, k in items])
            if name not in resumed:  # a resumed request's catching up is not a draft's cost
                self.costs.record_drafting(name, max(k for _, k in items),
                                           time.monotonic() - t_draft)
            for req, proposal in zip(reqs, proposals, strict=True):
                req.speculation.proposal = proposal
        seconds = time.monotonic() - t0
        if by_drafter:
            self.draft_rounds += 1
            self.draft_seconds += seconds
            for req, _ in (pair for items in by_drafter.values() for pair in items):
                req.metrics.draft_time += seconds

    def verified(self, chunk: ScheduledChunk, seconds: float) -> None:
        """A verification ran (its accepted drafts set): count it in its request's record and
        metrics and in the engine's totals."""
        req, drafted, accepted = chunk.req, len(chunk.draft), len(chunk.accepted)
        req.speculation.record(drafted, accepted)
        m = req.metrics
        m.draft_tokens += drafted
        m.accepted_tokens += accepted
        m.verify_time += seconds
        m.verify_steps += 1
        self.drafted += drafted
        self.accepted += accepted

    def timed(self, out: SchedulerOutput, result: StepResult, seconds: float) -> None:
        """The step that ran took `seconds`: recorded where it computed decodes and
        verifications only (called before the step's tokens are appended)."""
        if not result.encoder_time and all(
                chunk.num_tokens == 1 + len(chunk.draft) and chunk.samples
                for chunk in out.chunks):
            self.costs.record_step(sum(chunk.num_tokens for chunk in out.chunks), seconds)

    def after_step(self, out: SchedulerOutput, result: StepResult) -> None:
        """Let the drafters see the step that ran (before they propose for the next)."""
        for drafter in self.drafters.values():
            drafter.observe(out, result)

    def forget(self, req: Request) -> None:
        if req.speculation is not None:
            req.drop_drafts()
            self.drafters[req.speculation.method].forget(req)

    def stats(self) -> dict[str, object]:
        """Engine-wide counters for the panels (plain numbers)."""
        return {"speculative": str(self.method), "speculative_max_tokens": self.cap,
                "draft_rounds": self.draft_rounds, "draft_seconds": self.draft_seconds,
                "draft_tokens": self.drafted, "accepted_tokens": self.accepted,
                **self.costs.report()}


def build_speculator(config: EngineConfig, runner: ModelRunner, setup: CheckpointSetup,
                     blocks: BlockManager) -> Speculator | None:
    """The speculator of an engine started with `speculative` (None without): its drafter
    loaded, and what verification needs bound in the runner."""
    method = config.speculative_method
    if method is None:
        return None
    runner.bind_verify_backups()
    runner.pin_decode_kernels()
    if method.name == "ngram":
        drafter: Proposer = NgramProposer()
    elif method.name == "draft":
        from engine.hub import resolve_model
        from engine.speculative.assistant import AssistantProposer, is_assistant

        source = resolve_model(method.path)
        if is_assistant(source):  # Gemma 4's assistant: reads the target's state
            drafter = AssistantProposer.load(source, runner, setup.hf_config, setup.tokenizer,
                                             config)
        else:
            from engine.speculative.draft_model import DraftModelProposer

            drafter = DraftModelProposer.load(method.path, runner, config, setup.tokenizer,
                                              blocks)
    else:
        from engine.speculative.mtp import MTPProposer

        drafter = MTPProposer.load(runner, setup.path, setup.hf_config, config, blocks)
    return Speculator(method, config.num_speculative_tokens, drafter)
