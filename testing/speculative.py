"""Test helpers for speculative decoding: a drafter that proposes a known continuation (right
most of the time, wrong on purpose at fixed places, so that acceptance and rejection both run),
and a recorder of every logits row an engine samples, keyed by the exact tokens before it, so
that two runs' rows for the same prefix can be compared to the bit."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from engine import model_runner
from engine.request import Request
from engine.speculative.proposals import Proposal


class ScriptedDrafter:
    """Proposes each request's continuation from `script` (prompt ids -> output ids of a plain
    run), every `wrong_every`-th output position replaced by another token, and nothing past
    the script's end."""

    name = "ngram"
    cost_per_token = 0.0

    def __init__(self, script: Mapping[tuple[int, ...], Sequence[int]], vocab_size: int,
                 wrong_every: int = 4) -> None:
        self.script, self.vocab_size, self.wrong_every = script, vocab_size, wrong_every
        self.proposed = 0

    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[Proposal | None]:
        out: list[Proposal | None] = []
        for req, k in zip(reqs, ks, strict=True):
            ref = self.script.get(tuple(req.prompt_token_ids), ())
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
