"""models/layers/mrope.py against the rule the Qwen-VL checkpoints were trained with, and against
transformers' `get_rope_index` of tiny Qwen2-VL and Qwen2.5-VL models wherever transformers 5.23
follows that rule (everything except text after a video; see the pinned test below)."""

from __future__ import annotations

import pytest
import torch

from models.layers.mrope import decode_positions, mrope_positions, window_positions

IMAGE, VIDEO, START, END = 60, 61, 62, 63
MERGE = 2
TEXT = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, bos_token_id=None, eos_token_id=None,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
)
SPECIAL = dict(
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
    vision_end_token_id=END,
)


@pytest.fixture(scope="module")
def qwen2_vl():
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    vision = dict(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2)
    return Qwen2VLModel(Qwen2VLConfig(text_config=TEXT, vision_config=vision, **SPECIAL))


@pytest.fixture(scope="module")
def qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    vision = dict(
        depth=1, hidden_size=32, out_hidden_size=32, intermediate_size=32, num_heads=2,
        tokens_per_second=2, fullatt_block_indexes=[0],
    )
    return Qwen2_5_VLModel(Qwen2_5_VLConfig(text_config=TEXT, vision_config=vision, **SPECIAL))


def prompt(*parts) -> tuple[list[int], list[tuple], list[tuple]]:
    """Token ids from parts: an int n is n text tokens, ("image"|"video", (t, h, w)) a span."""
    ids, images, videos = [], [], []
    for part in parts:
        if isinstance(part, int):
            ids += [(len(ids) * 7) % 50 + 1 for _ in range(part)]
            continue
        kind, grid = part
        (images if kind == "image" else videos).append(grid)
        n = grid[0] * grid[1] * grid[2] // MERGE**2
        ids += [START] + [IMAGE if kind == "image" else VIDEO] * n + [END]
    return ids, images, videos


def hf_positions(model, ids, images, videos, seconds=None) -> tuple[torch.Tensor, int]:
    """transformers' positions [3, L] and delta; second_per_grid_ts float32 as its processor."""
    input_ids = torch.tensor([ids])
    kwargs = dict(
        mm_token_type_ids=(input_ids == IMAGE).int() + 2 * (input_ids == VIDEO).int(),
        image_grid_thw=torch.tensor(images) if images else None,
        video_grid_thw=torch.tensor(videos) if videos else None,
    )
    if seconds is not None:
        kwargs["second_per_grid_ts"] = torch.tensor(seconds, dtype=torch.float32)
    positions, deltas = model.get_rope_index(input_ids, **kwargs)
    return positions[:, 0], int(deltas[0, 0])


def ours(ids, images, videos, seconds=None, tokens_per_second=None):
    return mrope_positions(
        ids, image_grid_thw=images, video_grid_thw=videos, second_per_grid_ts=seconds,
        spatial_merge_size=MERGE, image_token_id=IMAGE, video_token_id=VIDEO,
        vision_start_token_id=START, tokens_per_second=tokens_per_second,
    )


CASES = {
    "text_only": [7],
    "one_image": [5, ("image", (1, 4, 6)), 3],
    "image_first_and_last": [("image", (1, 2, 2)), 0, ("image", (1, 4, 2))],
    "two_images": [3, ("image", (1, 4, 6)), 2, ("image", (1, 10, 4)), 4],
    "video": [4, ("video", (3, 4, 4)), 5],
    "long_video_small_frames": [2, ("video", (9, 2, 4)), 3],
    "interleaved": [2, ("image", (1, 6, 4)), 3, ("video", (4, 2, 6)), 1, ("image", (1, 2, 2)), 2],
    "two_videos": [1, ("video", (2, 4, 4)), 2, ("video", (5, 6, 2)), 3],
}


def trained_positions(ids, images, videos, seconds=None, tokens_per_second=None):
    """An independent, token-by-token transcription of the rule the checkpoints were trained
    with (Qwen's reference code, transformers 4.x, vLLM): a span's positions are its merged-grid
    coordinates plus the running position, and text after it continues from the span's largest
    position + 1. Returns positions [3, L] and the decode delta."""
    grids = {IMAGE: iter(images), VIDEO: iter(videos)}
    per_grid = iter(seconds if seconds is not None else [1.0] * len(videos))
    rows, nxt, i = [], 0, 0
    while i < len(ids):
        if ids[i] not in grids:
            rows.append((nxt, nxt, nxt))
            nxt, i = nxt + 1, i + 1
            continue
        t, h, w = next(grids[ids[i]])
        h, w = h // MERGE, w // MERGE
        scale = None
        if ids[i] == VIDEO and tokens_per_second is not None:
            scale = torch.tensor(next(per_grid), dtype=torch.float32) * tokens_per_second
        span = []
        for f in range(t):
            tf = f if scale is None else int((torch.tensor(f) * scale).long())
            span += [(nxt + tf, nxt + r, nxt + c) for r in range(h) for c in range(w)]
        rows += span
        nxt, i = max(max(p) for p in span) + 1, i + len(span)
    positions = torch.tensor(rows, dtype=torch.int64).t()
    return positions, int(positions.max()) + 1 - len(ids)


def first_video_end(ids) -> int:
    """Index just past the first video span (the whole prompt when there is none)."""
    if VIDEO not in ids:
        return len(ids)
    i = ids.index(VIDEO)
    while i < len(ids) and ids[i] == VIDEO:
        i += 1
    return i


@pytest.mark.parametrize("case", CASES)
def test_qwen2_vl_follows_the_trained_rule_and_transformers(qwen2_vl, case):
    ids, images, videos = prompt(*CASES[case])
    positions, delta = ours(ids, images, videos)
    assert positions.dtype == torch.int64 and positions.shape == (3, len(ids))
    trained, trained_delta = trained_positions(ids, images, videos)
    assert torch.equal(positions, trained) and delta == trained_delta
    expected, expected_delta = hf_positions(qwen2_vl, ids, images, videos)
    agree = first_video_end(ids)
    assert torch.equal(positions[:, :agree], expected[:, :agree])
    if VIDEO not in ids:
        assert torch.equal(positions, expected) and delta == expected_delta


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("second", [1.0, 0.5, 2 / 3, 0.083, 1.37])
def test_qwen2_5_vl_follows_the_trained_rule_and_transformers(qwen2_5_vl, case, second):
    ids, images, videos = prompt(*CASES[case])
    seconds = [second * (i + 1) for i in range(len(videos))]
    positions, delta = ours(ids, images, videos, seconds, tokens_per_second=2)
    trained, trained_delta = trained_positions(ids, images, videos, seconds, 2)
    assert torch.equal(positions, trained) and delta == trained_delta
    expected, expected_delta = hf_positions(qwen2_5_vl, ids, images, videos, seconds)
    agree = first_video_end(ids)
    assert torch.equal(positions[:, :agree], expected[:, :agree])
    if VIDEO not in ids:
        assert torch.equal(positions, expected) and delta == expected_delta


def test_transformers_5_23_reuses_positions_after_a_long_video(qwen2_5_vl):
    """Pins the transformers 5.23 behaviour we deliberately do not follow: after a video whose
    time extent (here 3 temporal patches x 2 tokens/s) exceeds its 2x2 merged grid, its next
    text position is start + max(h, w) / merge, inside the video's time range. If this test
    starts failing, transformers changed the rule: recheck models/layers/mrope.py against it."""
    ids, images, videos = prompt(4, ("video", (3, 4, 4)), 5)
    expected, _ = hf_positions(qwen2_5_vl, ids, images, videos, [1.0])
    positions, _ = ours(ids, images, videos, [1.0], tokens_per_second=2)
    after = first_video_end(ids) + 1  # the vision-end token, then text
    video_start = 5  # 4 text tokens, then the vision start
    assert int(expected[0, after]) == video_start + 2 + 1  # start + max(2, 2), then + 1
    assert int(positions[0, after]) == video_start + 4 + 1 + 1  # largest (t = 2 * 2) + 1, + 1


def test_qwen2_5_vl_default_second_per_grid(qwen2_5_vl):
    ids, images, videos = prompt(*CASES["interleaved"])
    positions, delta = ours(ids, images, videos, None, tokens_per_second=2)
    trained, trained_delta = trained_positions(ids, images, videos, None, 2)
    assert torch.equal(positions, trained) and delta == trained_delta
    expected, _ = hf_positions(qwen2_5_vl, ids, images, videos)
    agree = first_video_end(ids)
    assert torch.equal(positions[:, :agree], expected[:, :agree])


def test_large_grid_is_fast_and_consistent():
    ids, images, videos = prompt(3, ("video", (64, 40, 72)), 2)
    positions, delta = ours(ids, images, videos, [0.5], tokens_per_second=2)
    span = positions[:, 4 : 4 + 64 * 20 * 36]  # after 3 text tokens and the vision start
    assert torch.equal(span[0].unique(), torch.arange(64) + 4)
    assert span[1].max() == 4 + 19 and span[2].max() == 4 + 35
    assert delta == int(positions.max()) + 1 - len(ids)


@pytest.mark.parametrize(
    "parts, images, videos",
    [
        ([2, ("image", (1, 4, 4)), 1], [(1, 4, 4), (1, 2, 2)], []),  # a grid without a span
        ([2, ("image", (1, 4, 4)), 1], [(1, 4, 8)], []),  # span shorter than its grid
        ([2, ("image", (1, 4, 4)), 1], [], []),  # span without a grid
    ],
)
def test_mismatched_grids_raise(parts, images, videos):
    ids, _, _ = prompt(*parts)
    with pytest.raises(ValueError):
        ours(ids, images, videos)


def test_placeholder_outside_span_raises():
    ids, images, videos = prompt(2, ("image", (1, 2, 2)), 1)
    with pytest.raises(ValueError, match="placeholders"):
        ours([*ids, IMAGE], images, videos)


def full_positions(parts, generated: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Prompt positions, reference positions of prompt + generated tokens, and the delta."""
    ids, images, videos = prompt(*parts)
    prompt_pos, delta = ours(ids, images, videos, [0.5] * len(videos), tokens_per_second=2)
    ref_prompt, ref_delta = trained_positions(ids, images, videos, [0.5] * len(videos), 2)
    # Decode steps: the position of sequence index i past the prompt is i + delta.
    decoded = (torch.arange(len(ids), len(ids) + generated) + ref_delta).expand(3, -1)
    return prompt_pos, torch.cat([ref_prompt, decoded], dim=1), delta


def test_decode_positions():
    prompt_pos, full, delta = full_positions(CASES["interleaved"], 6)
    length = prompt_pos.shape[1]
    assert torch.equal(decode_positions(delta, length, 6), full[:, length:])
    assert torch.equal(decode_positions(delta, length + 2, 3), full[:, length + 2 : length + 5])
    assert decode_positions(delta, length, 0).shape == (3, 0)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_window_positions_chunked(chunk):
    prompt_pos, full, delta = full_positions(CASES["interleaved"], 9)
    total = full.shape[1]
    pieces = [
        window_positions(prompt_pos, delta, s, min(s + chunk, total))
        for s in range(0, total, chunk)
    ]
    assert torch.equal(torch.cat(pieces, dim=1), full)
    assert window_positions(prompt_pos, delta, 5, 5).shape == (3, 0)
    with pytest.raises(ValueError):
        window_positions(prompt_pos, delta, 4, 2)
