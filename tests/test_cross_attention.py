"""The cross-attention mechanism's pieces without a checkpoint: which rows see which image
(against transformers' own function), the per-step plan of the cross-attention layers, the
encoder cache and scheduler holding an item while rows attend to it, and the memory figure of
Llama 3.2 11B's cross-attention states for a 1120-pixel image (docs/architecture.md)."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.encoder_cache import EncoderCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from models.interfaces import CrossRows, MultiModalFeature, PlaceholderRange
from models.layers.cross_metadata import build_cross_metadata
from models.mllama.processor import cross_rows

IMAGE = 9


@pytest.mark.parametrize("ids", [
    [1, IMAGE, 2, 3],  # one image
    [1, IMAGE, 2, IMAGE, 3, 4],  # apart
    [IMAGE, IMAGE, 2, 3],  # together
    [1, IMAGE, 2, IMAGE, IMAGE, 5, IMAGE, 6],  # apart, then together, then apart
    [1, IMAGE, IMAGE],  # together at the end
])
def test_rows_per_image_are_transformers(ids):
    from transformers.models.mllama.processing_mllama import (
        convert_sparse_cross_attention_mask_to_dense,
        get_cross_attention_token_mask,
    )

    locations = [i for i, t in enumerate(ids) if t == IMAGE]
    sparse = get_cross_attention_token_mask(ids, IMAGE)
    dense = convert_sparse_cross_attention_mask_to_dense([sparse], [[1] * len(locations)], 1,
                                                         len(ids))[0, :, :, 0]
    for i, (start, end) in enumerate(cross_rows(locations)):
        rows = [r for r in range(len(ids)) if dense[r, i]]
        assert rows == list(range(start, len(ids) if end is None else end))
        # transformers' generate() repeats the last row for new tokens: None iff it attends
        assert (end is None) == bool(dense[-1, i])


def test_the_plan_splits_rows_where_images_start_and_end():
    a, b = torch.zeros(2, 2, 1, 3, 4), torch.zeros(2, 2, 1, 5, 4)
    # chunk 1: rows 0-9 of a request whose image a is seen by rows 4-5, b from 6 on;
    # chunk 2: a decode (row 10 of the batch) of a request seeing a; chunk 3: text only.
    plan = build_cross_metadata(
        [0, 20, 0], [10, 1, 5],
        [[(4, 6, a), (6, None, b)], [(3, None, a)], []], torch.device("cpu"))
    assert plan.rows.tolist() == [4, 5, 10, 6, 7, 8, 9]  # a's rows together, then b's
    assert [(s.lo, s.hi, len(s.states)) for s in plan.segments] == [(0, 3, 1), (3, 7, 1)]
    assert plan.segments[0].states[0] is a and plan.segments[1].states[0] is b
    together = build_cross_metadata([0], [4], [[(0, None, a), (1, None, b)]],
                                    torch.device("cpu"))
    assert together.rows is None  # every row attends: no gather
    assert [len(s.states) for s in together.segments] == [1, 2]
    assert build_cross_metadata([0, 7], [5, 1], [[], []], torch.device("cpu")) is None


def _request(features) -> Request:
    return Request("r", list(range(40)), SamplingParams(), frozenset(), 8, mm_features=features)


def _cross(offset: int, end: int | None, keys: int, name: str) -> MultiModalFeature:
    return MultiModalFeature("image", name, PlaceholderRange(offset, 1, is_embed=(False,)),
                             cross=CrossRows(offset, end, keys))


def test_an_item_is_held_while_rows_attend_to_it():
    first, last = _cross(3, 10, 20, "a"), _cross(10, None, 30, "b")
    req = _request([first, last])
    assert (first.encoder_size, first.needed_from, first.needed_until) == (20, 3, 10)
    cache = EncoderCacheManager(100)
    cache.allocate(req, "a", 20)
    cache.allocate(req, "b", 30)
    req.num_computed_tokens = 10
    cache.release_consumed(req)  # a's rows are computed; b is attended to the end
    assert cache.num_referenced == 1 and "a" in cache.freeable
    req.num_computed_tokens = 39
    cache.release_consumed(req)
    assert cache.num_referenced == 1
    cache.release_request(req)
    assert cache.num_referenced == 0 and cache.reclaimable == 100
    with pytest.raises(ValueError, match="rows start at 4"):
        MultiModalFeature("image", "c", PlaceholderRange(3, 1), cross=CrossRows(4, None, 1))


def test_the_scheduler_encodes_an_item_when_its_rows_come_and_cuts_before_it():
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler

    def scheduler(capacity: int) -> Scheduler:
        config = EngineConfig(max_num_batched_tokens=8, block_size=4)
        return Scheduler(config, BlockManager(64, 4, True), EncoderCacheManager(capacity))

    sched = scheduler(100)
    req = _request([_cross(10, None, 30, "b")])
    sched.add(req)
    out = sched.schedule()  # rows 0-7: text before the image, nothing to encode
    assert out.chunks[0].num_tokens == 8 and not out.encoder_inputs
    sched.update_after_step(out)
    out = sched.schedule()  # rows 8-15 reach the image
    assert out.encoder_inputs == [(req, 0)] and out.num_encoder_embeds == 30
    sched = scheduler(20)  # no room for the image's 30 key positions: cut before its token
    req = _request([_cross(10, None, 30, "b")])
    sched.add(req)
    sched.update_after_step(sched.schedule())
    out = sched.schedule()
    assert out.chunks[0].end == 10 and not out.encoder_inputs


LLAMA_3_2_11B = {  # meta-llama/Llama-3.2-11B-Vision's config.json (the shapes that matter)
    "text_config": {"hidden_size": 4096, "num_hidden_layers": 40, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
                    "cross_attention_layers": [3, 8, 13, 18, 23, 28, 33, 38]},
    "vision_config": {"hidden_size": 1280, "image_size": 560, "patch_size": 14,
                      "max_num_tiles": 4, "num_hidden_layers": 32, "num_global_layers": 8,
                      "attention_heads": 16, "intermediate_size": 5120,
                      "vision_output_dim": 7680,
                      "intermediate_layers_indices": [3, 7, 15, 23, 30]},
}


def test_the_states_of_a_1120_pixel_image_at_llama_3_2_11b():
    """The figure docs/architecture.md states, from the config: 4 tiles of 1601 positions,
    8 layers x (key + value) x 8 heads x 128 x 2 bytes (bfloat16) per position."""
    import transformers

    from engine.cross_states import plan_cross_states
    from models.mllama.model import MllamaForConditionalGeneration
    from models.mllama.preprocess import MllamaPreprocessConfig, num_tiles

    cfg = transformers.MllamaConfig(**LLAMA_3_2_11B)
    with torch.device("meta"):
        model = MllamaForConditionalGeneration(cfg, 1, torch.device("meta"))
    layout = plan_cross_states(model, EngineConfig(), torch.bfloat16, 0)
    pre = MllamaPreprocessConfig(560, 4, 2, True, 1 / 255, True, (0.5,) * 3, (0.5,) * 3)
    keys = num_tiles(1120, 1120, pre) * ((560 // 14) ** 2 + 1)
    assert (layout.num_layers, layout.bytes_per_key, keys) == (8, 32768, 6404)
    assert keys * layout.bytes_per_key == 209_846_272  # 200.1 MiB
    assert keys * 4096 * 2 == 52_461_568  # the projected features instead: 50.0 MiB
    assert len(model.attention_layers()) * 2 * 8 * 128 * 2 == 131_072  # KV per text token
