"""Test helpers for speculative decoding: a drafter that proposes a known continuation (right
most of the time, wrong on purpose at fixed places, so that acceptance and rejection both run),
and a recorder of every logits row an engine samples, keyed by the exact tokens before it, so
that two runs' rows for the same prefix can be compared to the bit."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from engine import model_runner
from engine.outputs import RequestOutput
from engine.request import Request
from engine.speculation_state import Proposal


class ScriptedDrafter:
    """Proposes each request's continuation from `script` ((prompt ids, completion index) ->
    output ids of a plain run), every `wrong_every`-th output position replaced by another
    token, and nothing past the script's end."""

    name = "ngram"
    cost_per_token = 0.0

    def __init__(self, script: Mapping[tuple[tuple[int, ...], int], Sequence[int]],
                 vocab_size: int,
                 wrong_every: int = 4) -> None:
        self.script, self.vocab_size, self.wrong_every = script, vocab_size, wrong_every
        self.proposed = 0

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[Proposal | None]:
        out: list[Proposal | None] = []
        for req, k in zip(reqs, ks, strict=True):
            ref = self.script.get((tuple(req.prompt_token_ids), req.index), ())
            at = req.num_output_tokens
            draft = [t if (at + i) % self.wrong_every != self.wrong_every - 1
                     else (t + 1) % self.vocab_size for i, t in enumerate(ref[at : at + k])]
            self.proposed += len(draft)
            out.append(Proposal(tuple(draft)) if draft else None)
        return out

    def forget(self, req: Request) -> None:
        pass

    def observe(self, out: object, result: object) -> None:
        pass


class LogitsRecorder:
    """Records, while installed, every sampled row's logits under the tokens before the row
    (the prompt's and the output's, drafts included). Install with `with LogitsRecorder() as
    rec:` around generate()."""

    def __init__(self) -> None:
        self.rows: dict[tuple[int, ...], torch.Tensor] = {}
        self._sample = model_runner.sample
        self._rows = model_runner.sample_rows
        self._pending = None

    def __enter__(self) -> LogitsRecorder:
        def rows(chunks):
            out = self._rows(chunks)
            self._pending = [tuple(r.all_token_ids) + tuple(ahead)
                             for r, ahead in zip(out.reqs, out.ahead, strict=True)]
            return out

        def sample(logits, batch):
            for key, row in zip(self._pending, logits, strict=True):
                self.rows[key] = row.clone()
            return self._sample(logits, batch)

        model_runner.sample_rows, model_runner.sample = rows, sample
        return self

    def __exit__(self, *exc) -> None:
        model_runner.sample_rows, model_runner.sample = self._rows, self._sample


@dataclass
class Parity:
    """Outputs and sampled logits rows of a run without speculation and one with it."""

    plain: list[RequestOutput]
    speculative: list[RequestOutput]
    plain_rows: dict[tuple[int, ...], torch.Tensor]
    rows: dict[tuple[int, ...], torch.Tensor]

    def assert_identical(self, bitwise: bool = True) -> None:
        """The same tokens (and finish reasons, texts, logprobs); drafts were both accepted and
        rejected; with `bitwise`, every row both runs sampled after the same tokens has the
        same logits to the bit."""
        for a, b in zip(self.plain, self.speculative, strict=True):
            for x, y in zip(a.outputs, b.outputs, strict=True):
                assert x.token_ids == y.token_ids, (a.request_id, x.token_ids, y.token_ids)
                assert (x.text, x.finish_reason, x.stop_reason) == (
                    y.text, y.finish_reason, y.stop_reason)
                assert x.logprobs == y.logprobs
        drafted = sum(o.metrics.draft_tokens for o in self.speculative)
        accepted = sum(o.metrics.accepted_tokens for o in self.speculative)
        assert 0 < accepted < drafted, (accepted, drafted)
        if bitwise:
            common = [k for k in self.rows if k in self.plain_rows]
            assert len(common) >= len(self.plain_rows) // 2, (len(common), len(self.plain_rows))
            for key in common:
                a, b = self.rows[key], self.plain_rows[key]
                assert torch.equal(a, b), (len(key), (a - b).abs().max().item())


def run_parity(llm, generate: Callable[[dict], list[RequestOutput]],
               wrong_every: int = 4) -> Parity:
    """`generate(overrides)` runs the same requests with SamplingParams fields `overrides`:
    first without speculation, then drafted by a ScriptedDrafter that knows the first run's
    outputs (installed as the engine's n-gram drafter, which the requests then choose), the
    cost of a draft held (the number of drafts set by acceptance, not by this run's timing)."""
    with LogitsRecorder() as plain:
        off = generate({"num_speculative_tokens": 0})
    script = {(tuple(o.prompt_token_ids), c.index): c.token_ids
              for o in off for c in o.outputs}
    llm.engine.speculator.drafters["ngram"] = ScriptedDrafter(
        script, llm.engine.runner.vocab_size, wrong_every)
    llm.engine.speculator.costs.hold(0.08)  # drafts by acceptance alone, not by timing
    with LogitsRecorder() as spec:
        on = generate({"speculative_method": "ngram"})
    return Parity(off, on, plain.rows, spec.rows)
