"""Qwen3-VL through the whole engine, against transformers on a tiny random
Qwen3VLForConditionalGeneration (Qwen3 decoder with interleaved mRoPE; 16-px tower with learned
positions; DeepStack residuals from two tower blocks into the first two decoder layers).

Greedy tokens identical and top log-probabilities within tolerance for one image, two images, a
video whose temporal groups carry "<t seconds>" text, text-only batch mates, chunks that end
inside image spans (the DeepStack residuals are sliced per chunk), an encoder-cache hit and a
prefix-cache hit. Positions equal transformers' get_rope_index; preprocessing equals
transformers' image processor and its Qwen3-VL video resize and timestamp rules.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers import (
    assert_matches_reference,
    assert_released,
    assert_rope_index_positions,
    count_calls,
    greedy,
    process_chat,
    qwen_vl_reference,
    random_image,
    random_video,
    user,
)

N = 8
GREEDY = greedy(N)


CASES = {
    "one_image": user(random_image(120, 150, 0), "Describe the image in detail."),
    "two_images": user("Compare", random_image(64, 64, 1), "with", random_image(150, 70, 2),
                        "please."),
    "video": user(random_video(6, 64, 96, 3), "What is shown in this video?"),
    "text_only": user("Hello there, how are you today?"),
}


@pytest.fixture(scope="module")
def qwen3_vl_path(tmp_path_factory):
    from testing.qwen3_vl import build_qwen3_vl_model

    return build_qwen3_vl_model(tmp_path_factory.mktemp("qwen3_vl") / "m")


@pytest.fixture(scope="module")
def refs(qwen3_vl_path, hf_models):
    llm = LLM(qwen3_vl_path, max_model_len=2048)
    hf = hf_models(qwen3_vl_path)
    return {case: qwen_vl_reference(hf, llm, msgs, N) for case, msgs in CASES.items()}


def test_positions_match_get_rope_index(qwen3_vl_path, hf_models):
    llm = LLM(qwen3_vl_path, max_model_len=2048)
    hf = hf_models(qwen3_vl_path)
    for case in ("two_images", "video"):
        assert_rope_index_positions(llm, hf, CASES[case], case)


def test_video_groups_carry_timestamps_inside_their_spans(qwen3_vl_path):
    llm = LLM(qwen3_vl_path, max_model_len=2048)
    proc, media = process_chat(llm, CASES["video"])
    tok = llm.engine.tokenizer
    spans = [f.placeholder for f in proc.mm_features]
    assert len(spans) == 3  # six frames, two per temporal group
    for span, seconds in zip(spans, ("<0.2 seconds>", "<1.2 seconds>", "<2.2 seconds>"),
                             strict=True):
        assert span.is_embed is not None and not span.is_embed[0] and span.is_embed[-2]
        text = tok.decode(proc.token_ids[span.offset : span.end])
        assert text.startswith(seconds + "<|vision_start|>") and text.endswith("<|vision_end|>")
    times = media["video"][0].timestamps
    assert np.allclose(times, np.arange(6) / 2)  # sampled at 2 fps
    # What the UI is told: the timestamp text and the vision markers inside each span.
    out = llm.chat(CASES["video"], SamplingParams(max_tokens=1))[0]
    for ph, seconds in zip(out.multi_modal_placeholders,
                           ("<0.2 seconds>", "<1.2 seconds>", "<2.2 seconds>"), strict=True):
        inside = [out.prompt_token_ids[ph.offset + k] for k in ph.text_offsets]
        assert tok.decode(inside) == seconds + "<|vision_start|><|vision_end|>"


def test_each_case_matches_transformers(qwen3_vl_path, refs):
    llm = LLM(qwen3_vl_path, max_model_len=2048)
    params = greedy(N, logprobs=3)
    for case, msgs in CASES.items():
        assert_matches_reference(llm.chat(msgs, params)[0], *refs[case], case)
    assert_released(llm)


def test_deepstack_changes_the_output(qwen3_vl_path, refs):
    """With the residuals dropped the log-probabilities move: the parity above exercises
    DeepStack (the reference's log-probabilities are matched to 1e-3)."""
    llm = LLM(qwen3_vl_path, max_model_len=2048)
    model = llm.engine.runner.model
    forward = model.forward
    model.forward = lambda ids, pos, meta, embeds=None, residuals=None: forward(
        ids, pos, meta, embeds, None)
    params = greedy(1, logprobs=1)
    out = llm.chat(CASES["one_image"], params)[0]
    (token, logprob), = out.outputs[0].logprobs[0].items()
    assert abs(logprob - refs["one_image"][1][0, token].item()) > 0.05


def test_batch_in_chunks_inside_spans_with_caches(qwen3_vl_path, refs):
    llm = LLM(qwen3_vl_path, max_model_len=2048, max_num_batched_tokens=10, max_num_seqs=8,
              enable_prefix_caching=False)
    tower = count_calls(llm.engine.runner.model.visual)
    outs = llm.chat(list(CASES.values()), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [refs[c][0] for c in CASES]
    assert any(p.length > 10 for o in outs for p in o.multi_modal_placeholders)
    calls = tower[0]
    again = llm.chat(CASES["one_image"], GREEDY)[0]  # encoder-cache hit: no tower call
    assert again.outputs[0].token_ids == refs["one_image"][0] and tower[0] == calls
    # The cache holds the embeddings and both residuals: three vectors per embedding.
    span = again.multi_modal_placeholders[0]
    assert llm.stats()["encoder_cache_used"] >= 3 * span.num_embeds
    assert_released(llm)


def test_prefix_cache_hit_after_an_random_image(qwen3_vl_path, refs):
    llm = LLM(qwen3_vl_path, max_model_len=2048, block_size=8)
    first = llm.chat(CASES["one_image"], GREEDY)[0]
    again = llm.chat(CASES["one_image"], GREEDY)[0]
    span = first.multi_modal_placeholders[0]
    assert again.num_cached_tokens > span.offset + span.length
    assert again.outputs[0].token_ids == refs["one_image"][0]
    assert_released(llm)


def test_image_preprocessing_matches_transformers(qwen3_vl_path):
    import transformers

    llm = LLM(qwen3_vl_path, max_model_len=2048)
    hf_proc = transformers.Qwen2VLImageProcessorPil.from_pretrained(qwen3_vl_path)
    for img in (random_image(120, 150, 0), random_image(33, 250, 5),
                random_image(500, 70, 6)):
        proc, _ = process_chat(llm, user(img, "x"))
        ref = hf_proc(images=[img], return_tensors="pt")
        (f,) = proc.mm_features
        assert tuple(f.data["grid_thw"]) == tuple(ref["image_grid_thw"][0].tolist())
        torch.testing.assert_close(f.data["pixel_values"], ref["pixel_values"], atol=1e-5,
                                   rtol=0)


def _reference_video_resize():
    """transformers' Qwen3-VL video smart_resize: its module needs torchvision to import, so
    the one function is compiled from the module's source."""
    import ast
    import importlib.util
    import math
    import pathlib

    spec = importlib.util.find_spec("transformers.models.qwen3_vl")
    source = (pathlib.Path(spec.origin).parent / "video_processing_qwen3_vl.py").read_text()
    tree = ast.parse(source)
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize"]
    namespace = {"math": math}
    exec(compile(ast.Module([fn], []), "video_processing_qwen3_vl.py", "exec"), namespace)
    return namespace["smart_resize"]


def test_video_resize_and_timestamps_follow_qwen3_vl():
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    from models.processing.qwen_vision import VisionPreprocessConfig, smart_resize_clip
    from models.qwen_vl.processor import _group_seconds

    reference = _reference_video_resize()
    rng = np.random.default_rng(0)
    for _ in range(300):
        t, h, w = int(rng.integers(2, 60)), int(rng.integers(10, 900)), int(rng.integers(10, 900))
        lo, hi = 128 * 32 * 32, 32 * 32 * 768
        assert smart_resize_clip(t, h, w, 32, lo, hi) == reference(t, h, w, 2, 32, lo, hi)
    cfg = VisionPreprocessConfig()
    indices = [0, 3, 6, 9, 12]
    ours = _group_seconds(np.array(indices) / 24.0, cfg)
    assert ours == pytest.approx(Qwen3VLProcessor._calculate_timestamps(None, indices, 24.0, 2))
