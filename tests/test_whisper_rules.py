"""Whisper's token rules (models/whisper/rules.py, applied by engine/rule_batch.py) against
transformers' logits processors on the same scores: for random generated prefixes (text,
timestamps in and out of pairs, the first step) and random scores, the processed scores of
SuppressTokensAtBegin + SuppressTokens + WhisperTimeStamp equal ours, every row of a batch
ruled on its own."""

from __future__ import annotations

import random

import pytest
import torch

from engine.rule_batch import RuleBatch
from models.whisper.rules import WhisperRules

VOCAB, END, NO_TS = 120, 50, 60  # text below 50, specials 50..60, timestamps from 61
BEGIN = NO_TS + 1
PROMPT = [51, 52]


def hf_processed(prefixes, scores, rules: WhisperRules) -> torch.Tensor:
    from transformers import GenerationConfig
    from transformers.generation.logits_process import (
        SuppressTokensAtBeginLogitsProcessor,
        SuppressTokensLogitsProcessor,
        WhisperTimeStampLogitsProcessor,
    )

    begin = len(PROMPT)
    config = GenerationConfig(no_timestamps_token_id=NO_TS, eos_token_id=END,
                              max_initial_timestamp_index=rules.max_initial_timestamp_index)
    chain = [SuppressTokensAtBeginLogitsProcessor(list(rules.begin_suppress), begin),
             SuppressTokensLogitsProcessor(list(rules.suppress)),
             WhisperTimeStampLogitsProcessor(config, begin_index=begin)]
    out = []
    for prefix, row in zip(prefixes, scores, strict=True):
        ids = torch.tensor([PROMPT + prefix])
        s = row[None].clone()
        for proc in chain:
            s = proc(ids, s)
        out.append(s[0])
    return torch.stack(out)


def random_prefix(rng: random.Random) -> list[int]:
    out: list[int] = []
    stamp = BEGIN
    for _ in range(rng.choice([0, 0, 1, 2, 3, 5, 8])):
        if rng.random() < 0.5:
            stamp = min(VOCAB - 1, stamp + rng.choice([0, 0, 1, 3]))
            out.append(stamp)
        else:
            out.append(rng.randrange(END))
    return out


@pytest.mark.parametrize("max_initial", [None, 3])
def test_rules_equal_transformers_processors(max_initial):
    rng = random.Random(max_initial or 0)
    rules = WhisperRules(END, NO_TS, suppress=(53, 57), begin_suppress=(0, END), timestamps=True,
                         max_initial_timestamp_index=max_initial)
    for trial in range(20):
        prefixes = [random_prefix(rng) for _ in range(6)]
        torch.manual_seed(trial)
        scores = torch.randn(6, VOCAB) * 3
        # some rows where the timestamps' summed probability wins, some where it does not
        scores[::2, BEGIN:] += 2.0
        ours = scores.clone()
        RuleBatch.build([(i, rules.mask(p)) for i, p in enumerate(prefixes)],
                        torch.device("cpu")).apply(ours)
        want = hf_processed(prefixes, scores, rules)
        assert torch.equal(ours.isinf(), want.isinf()), (trial, prefixes)
        torch.testing.assert_close(ours[~ours.isinf()], want[~want.isinf()])


def test_without_timestamps_only_the_suppression_applies():
    rules = WhisperRules(END, NO_TS, suppress=(53,), begin_suppress=(7,), timestamps=False)
    assert rules.mask([]).tokens == (53, 7) and rules.mask([3]).tokens == (53,)
    assert not rules.mask([BEGIN, 3]).ranges and rules.mask([]).force_from is None
