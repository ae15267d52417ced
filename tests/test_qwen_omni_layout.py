"""models/qwen_omni/layout.py, pure Python: the chunk rule equals transformers' (the processor's
and the model's copies) on random times, gaps of several chunks included; interleaving keeps
every token once, in order per modality; positions follow the running maximum."""

from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch

from models.qwen_omni.layout import Positions, chunk_runs, grid_offsets, interleave


def _times(rng: random.Random, n: int) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.choice([0, 0, 0, 12.5, 25, 50, 75, 130])  # repeats, steps, multi-chunk gaps
        out.append(t)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_chunk_runs_equal_transformers(seed):
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniPreTrainedModelForConditionalGeneration as Model,
    )
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor

    rng = random.Random(seed)
    times = _times(rng, rng.randrange(0, 60))
    per_chunk = rng.choice([25, 50, 100])
    ours = chunk_runs(times, per_chunk)
    stub = types.SimpleNamespace()
    assert ours == Qwen2_5OmniProcessor.get_chunked_index(stub, np.array(times), per_chunk)
    # The model's copy takes integer positions, counted from the item's first one.
    whole = [float(int(t)) for t in times]
    base = rng.randrange(0, 1000)
    model = Model.get_chunked_index(stub, torch.tensor(whole).long() + base, per_chunk, base)
    assert chunk_runs(whole, per_chunk) == [(int(a), int(b)) for a, b in model]


def test_interleave_takes_every_token_once_in_order():
    rng = random.Random(0)
    for _ in range(50):
        video = sorted(_times(rng, rng.randrange(1, 40)))
        runs = interleave(video, rng.randrange(0, 200), 50)
        for modality in ("video", "audio"):
            mine = [(r.start, r.end) for r in runs if r.modality == modality]
            flat = [i for a, b in mine for i in range(a, b)]
            assert flat == sorted(flat) and len(set(flat)) == len(flat)
        assert all(r.length > 0 for r in runs)


def test_a_regular_video_alternates_per_chunk():
    # 4 temporal patches one second apart (25 positions), 2 tokens each; 4 s of sound (100).
    video = [t * 25.0 for t in range(4) for _ in range(2)]
    runs = [(r.modality, r.start, r.end) for r in interleave(video, 100, 50)]
    assert runs == [("video", 0, 4), ("audio", 0, 50), ("video", 4, 8), ("audio", 50, 100)]


def test_positions_follow_the_running_maximum():
    p = Positions()
    p.text(3)  # 0, 1, 2
    p.content(*grid_offsets([0, 25], 2, 2))  # t in {3, 28}, h and w in {3, 4}
    assert p.next == 29 and p.rows[0][3:] == [3] * 4 + [28] * 4
    p.repeat_last()
    p.text()
    assert [r[-2:] for r in p.rows] == [[28, 29], [4, 29], [4, 29]]
