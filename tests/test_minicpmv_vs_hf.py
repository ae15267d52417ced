"""MiniCPM-V 4.6 through the whole engine, against transformers on a tiny random checkpoint
(64-px slices of 16 embeddings, a 3-block tower with the window merger after block 1, Qwen3.5's
hybrid decoder; testing/minicpmv.py).

The reference's prompt ids come from transformers' own MiniCPMV4_6Processor (its slice text,
image ids and frame layout), its image pixels from MiniCPMV4_6ImageProcessorPil; video frames
are ours (the video processor resizes with torchvision, absent here: its stand-in hands the
processor our frames' pixels, and the processor writes their text). Greedy tokens identical and
top-3 log-probabilities within 1e-3 for one image, two images of different slice grids, a video,
text only and an image after a video, in one batch; per-request options (max_slice_nums,
downsample_mode "4x", use_image_id) with transformers given the same; chunk budgets ending on
pads and on the structure tokens inside a picture's span; encoder-cache and prefix-cache hits.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine import LLM
from tests.helpers import (
    assert_matches_reference,
    assert_released,
    count_calls,
    greedy,
    hf_greedy,
    process_chat,
    random_image,
    random_video,
    user,
)

N = 6
GREEDY = greedy(N)
LOGPROBS = greedy(N, logprobs=3)
IMAGE = random_image(90, 150, 0)  # 2 x 2 slices
CASES = {
    "one_image": user(IMAGE, "Describe the image in detail."),
    # Wide and tall: slice grids 1 x 2 and 3 x 1.
    "two_images": user("Compare", random_image(60, 130, 1), "with", random_image(170, 50, 2),
                       "please."),
    "video": user("What happens in", random_video(3, 80, 120, 5), "this clip?"),
    "text_only": user("Hello there, how are you today?"),
    "video_then_image": user(random_video(2, 40, 50, 6), "and", random_image(30, 40, 7), "?"),
}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from testing.minicpmv import build_minicpmv_model

    return build_minicpmv_model(tmp_path_factory.mktemp("minicpmv") / "m")


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, max_model_len=2048, max_num_seqs=8)


class FramesStandIn:
    """transformers' video processor with its output replaced by our frames' pixels (its own
    resizing needs torchvision); every other attribute is the real processor's."""

    def __init__(self, real, features) -> None:
        self.real, self.features = real, features

    def __getattr__(self, name):
        return getattr(self.real, name)

    def __call__(self, videos, **kwargs):
        from transformers.feature_extraction_utils import BatchFeature

        data = [f.data for f in self.features]
        return BatchFeature({
            "pixel_values_videos": torch.cat([d["pixel_values"] for d in data], -1)[None],
            "target_sizes_videos": torch.tensor([g for d in data for g in d["patch_grids"]],
                                                dtype=torch.int32),
            "grids_videos": torch.tensor([d["layout"].grid for d in data], dtype=torch.int32),
            "num_frames_per_video": [sum(1 for _ in data)],
        }, skip_tensor_conversion=["grids_videos", "num_frames_per_video"])


def reference_inputs(path, llm, messages, **kwargs) -> dict:
    """transformers' inputs for `messages` (its processor given `kwargs`), checked to be our
    prompt ids."""
    from testing.minicpmv import load_hf_processor

    proc, media = process_chat(llm, messages, kwargs or None)
    text = llm.engine.processor.render_chat(messages).text
    hf_proc = load_hf_processor(path)
    videos = [f for f in proc.mm_features if f.modality == "video"]
    if videos:  # one video per prompt here
        hf_proc.video_processor = FramesStandIn(hf_proc.video_processor, videos)
    inputs = dict(hf_proc(text=[text], images=media.get("image"),
                          videos=[v.frames for v in media.get("video", [])] or None,
                          return_tensors="pt", **kwargs))
    assert inputs["input_ids"][0].tolist() == proc.token_ids
    return inputs


@pytest.fixture(scope="module")
def refs(path, llm, hf_models):
    hf = hf_models(path)
    out = {}
    for case, messages in CASES.items():
        inputs = reference_inputs(path, llm, messages)
        out[case] = hf_greedy(hf, inputs, inputs["input_ids"].shape[1], N)
    return out


def test_each_case_matches_transformers(llm, refs):
    outs = llm.chat(list(CASES.values()), LOGPROBS)  # one batch, text-only mate included
    for case, out in zip(CASES, outs, strict=True):
        assert_matches_reference(out, *refs[case], label=case)
    assert_released(llm)


def test_pictures_are_spans_with_their_structure_as_text(llm):
    tok = llm.engine.tokenizer
    proc, _ = process_chat(llm, CASES["two_images"])
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    for feature, grid in zip(proc.mm_features, [(1, 2), (3, 1)], strict=True):
        span = feature.placeholder
        ids = proc.token_ids[span.offset:span.end]
        assert feature.data["layout"].grid == grid
        assert span.is_embed == tuple(t == pad for t in ids) and span.num_embeds < span.length
        assert tok.convert_ids_to_tokens(ids[0]) == "<image>"
        assert tok.convert_ids_to_tokens(ids[-1]) == "</slice>"
        assert tok.decode(proc.token_ids[span.offset - 3:span.offset]) == (
            f"<image_id>{proc.mm_features.index(feature)}</image_id>")
    assert "</slice>\n<slice>" in tok.decode(proc.token_ids)  # rows of the 3 x 1 grid
    video = process_chat(llm, CASES["video"])[0].mm_features
    assert [f.modality for f in video] == ["video"] * 3  # one item per frame
    assert [f.part for f in video] == ["frame 0 at 0.0 s", "frame 1 at 1.0 s", "frame 2 at 2.0 s"]
    assert video[0].placeholder.end == video[1].placeholder.offset


def test_pixels_equal_transformers_image_processor(tmp_path):
    import transformers

    from models.checkpoint import Found, read_settings
    from models.minicpmv.preprocess import IMAGE_PROCESSORS, SliceConfig, image_pixels
    from models.minicpmv.preprocess import preprocess_picture as ours

    schema = IMAGE_PROCESSORS["MiniCPMV4_6ImageProcessor"]
    sizes = [(90, 150), (170, 50), (33, 33), (7, 200), (301, 97), (64, 64), (128, 129)]
    settings = [{"scale_resolution": 64, "patch_size": 4, "max_slice_nums": 4},
                {"scale_resolution": 56, "patch_size": 7, "max_slice_nums": 9},
                {"scale_resolution": 64, "patch_size": 4, "downsample_mode": "4x"},
                {"scale_resolution": 64, "patch_size": 4, "slice_mode": False}]
    for options in settings:
        hf = transformers.MiniCPMV4_6ImageProcessorPil(**options)
        cfg = SliceConfig.from_settings(read_settings(Found(hf.to_dict(), "f"), schema))
        for seed, (h, w) in enumerate(sizes):
            image = random_image(h, w, seed)
            ref = hf([image], return_tensors="pt")
            pixels, layout = ours(image_pixels(image, cfg), cfg)
            assert list(layout.grid) == list(ref["grids"][0]), (options, h, w)
            assert layout.patch_grids == tuple(map(tuple, ref["target_sizes"].tolist()))
            torch.testing.assert_close(pixels, ref["pixel_values"][0], atol=1e-6, rtol=0)


def test_video_frames_are_those_the_reference_samples(llm):
    """Frames as MiniCPMV4_6VideoProcessor.sample_frames picks them (the checkpoint's
    max_num_frames is 8): one a second of a short video; of a long one, 8 of its 0.1 s marks."""
    from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import (
        MiniCPMV4_6VideoProcessor,
    )
    from transformers.video_utils import VideoMetadata

    from tests.media_fixtures import VideoSpec, encode_video, level

    reference = MiniCPMV4_6VideoProcessor(max_num_frames=8)
    for frames in (3, 14):
        _, media = process_chat(llm, user(random_video(frames, 16, 24, frames), "Go."))
        meta = VideoMetadata(total_num_frames=frames, fps=1.0, duration=float(frames))
        assert media["video"][0].timestamps.tolist() == [
            float(i) for i in reference.sample_frames(meta)]
    # An encoded 14.5 s video at 10 fps, decoded by seeking to the reference's frames.
    data = encode_video(VideoSpec(frames=145, fps=10, width=32, height=24))
    _, media = process_chat(llm, user(data, "Go."))
    picked = reference.sample_frames(VideoMetadata(total_num_frames=145, fps=10.0,
                                                   duration=14.5))
    video = media["video"][0]
    np.testing.assert_allclose(video.timestamps, np.array(picked) / 10.0, atol=1e-6)
    assert np.abs(video.frames.mean(axis=(1, 2, 3)) - [level(i) for i in picked]).max() < 8


def test_request_options_match_transformers(path, llm, hf_models):
    """max_slice_nums, downsample_mode and use_image_id per request, transformers' processor
    and model given the same."""
    hf = hf_models(path)
    options = {"max_slice_nums": 2, "downsample_mode": "4x", "use_image_id": False}
    messages = CASES["one_image"]
    inputs = reference_inputs(path, llm, messages, **options)
    tokens, logprobs = hf_greedy(hf, {**inputs, "downsample_mode": "4x"},
                                 inputs["input_ids"].shape[1], N)
    out = llm.chat(messages, LOGPROBS, mm_processor_kwargs=options)[0]
    assert_matches_reference(out, tokens, logprobs, label="options")
    default = process_chat(llm, messages)[0].mm_features[0].placeholder
    assert out.multi_modal_placeholders[0].num_embeds > 2 * default.num_embeds
    for bad, message in (({"max_slice_nums": 0}, r"max_slice_nums=0 is not an integer in "
                                                  r"\[1, \d+\] \(slices per image"),
                         ({"downsample_mode": "8x"}, r"downsample_mode='8x' is not one of "
                                                     r"'16x', '4x'"),
                         ({"use_image_id": 1}, r"use_image_id=1 is not true or false"),
                         ({"max_pixels": 9}, r"unknown mm_processor_kwargs max_pixels")):
        with pytest.raises(ValueError, match=message):
            llm.chat(messages, GREEDY, mm_processor_kwargs=bad)
    assert_released(llm)


def _boundary_budget(span) -> int:
    """The largest token budget whose chunk boundaries (for one request alone) fall inside
    `span` both on a structure token and on a pad."""
    for budget in range(40, 4, -1):
        cuts = [span.is_embed[end - span.offset] for end in range(budget, span.end, budget)
                if span.offset < end < span.end]
        if True in cuts and False in cuts:
            return budget
    raise AssertionError("no such budget")


def test_chunk_boundaries_inside_spans(path, llm, refs):
    """Chunks ending on pads and on the structure tokens between them, alone, then in a batch
    where every request is cut in several places."""
    messages = CASES["one_image"]
    span = process_chat(llm, messages)[0].mm_features[0].placeholder
    small = LLM(path, max_model_len=2048, max_num_batched_tokens=_boundary_budget(span),
                max_num_seqs=8, enable_prefix_caching=False)
    assert_matches_reference(small.chat(messages, LOGPROBS)[0], *refs["one_image"],
                             label="one image in chunks")
    cases = ["one_image", "video", "text_only"]
    outs = small.chat([CASES[c] for c in cases], LOGPROBS)
    for case, out in zip(cases, outs, strict=True):
        assert_matches_reference(out, *refs[case], label=f"{case} in a batch in chunks")
    assert_released(small)


def test_encoder_cache_and_prefix_cache_hits(path, refs, hf_models):
    cold = LLM(path, max_model_len=2048, enable_prefix_caching=False)
    tower = count_calls(cold.engine.runner.model.vision_tower)
    cold.chat([CASES["video"], CASES["one_image"]], GREEDY)  # both in one tower forward
    assert tower[0] == 1
    again = cold.chat(CASES["video"], GREEDY)[0]  # every frame an encoder-cache hit
    assert again.outputs[0].token_ids == refs["video"][0] and tower[0] == 1
    assert all(p.cache_hit for p in again.multi_modal_placeholders)
    # The image's blocks and the decoder's state after them come back from the prefix cache.
    warm = LLM(path, max_model_len=2048, block_size=4)
    first = warm.chat(CASES["one_image"], GREEDY)[0]
    out = warm.chat(user(IMAGE, "What colours dominate?"), LOGPROBS)[0]
    inputs = reference_inputs(path, warm, user(IMAGE, "What colours dominate?"))
    tokens, logprobs = hf_greedy(hf_models(path), inputs, inputs["input_ids"].shape[1], N)
    assert first.outputs[0].token_ids == refs["one_image"][0]
    assert_matches_reference(out, tokens, logprobs, label="prefix hit")
    assert out.num_cached_tokens >= out.multi_modal_placeholders[0].offset + \
        out.multi_modal_placeholders[0].length - 4
    assert warm.stats()["state_snapshot_hits"] >= 1
    assert_released(warm)


def test_plans_agree_with_processing(llm):
    p = llm.engine.processor
    mm = p.mm_processor
    for messages, options in ((CASES["two_images"], {}), (CASES["video_then_image"], {}),
                              (CASES["one_image"], {"downsample_mode": "4x",
                                                    "use_image_id": False})):
        parsed = p.render_chat(messages, mm_processor_kwargs=options)
        media = p.load_media_sync(parsed)
        ids = llm.engine.tokenizer.encode(parsed.text, add_special_tokens=False)
        plan, out = mm.plan(ids, media, options), mm.process(ids, media, options)
        assert plan.num_tokens == len(out.token_ids)
        assert plan.item_embeds == [(f.modality, f.placeholder.num_embeds)
                                    for f in out.mm_features]


def test_tower_has_no_host_sync(llm):
    from tests.model_fixtures import SyncRecorder

    model = llm.engine.runner.model
    proc, _ = process_chat(llm, CASES["video_then_image"])
    items = [(f.modality, f.data) for f in proc.mm_features]
    four = {**items[-1][1], "merged": False}  # a "4x" picture beside them
    items.append(("image", four))
    with torch.inference_mode(), SyncRecorder() as rec:
        embeds = model.encode(items)
    assert rec.seen == []
    assert [e.shape[0] for e in embeds] == [f.placeholder.num_embeds for f in proc.mm_features] \
        + [sum(h * w // 4 for h, w in four["patch_grids"])]


@pytest.mark.parametrize(("name", "edit", "message"), [
    ("config.json", lambda c: c.update(downsample_mode="4x"),
     r"downsample_mode='16x' but config.json downsample_mode='4x'"),
    ("processor_config.json", lambda c: c["video_processor"].update(stack_frames=2),
     r"video_processor: stack_frames=2 is not supported"),
])
def test_checkpoint_settings_the_model_cannot_honour_are_refused(path, tmp_path, name, edit,
                                                                 message):
    import shutil

    from models.checkpoint import CheckpointError

    copy = tmp_path / "m"
    shutil.copytree(path, copy)
    data = json.loads((copy / name).read_text())
    edit(data)
    (copy / name).write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=message):
        LLM(copy, max_model_len=256)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_the_cpu_and_the_tower_does_not_synchronize(path):
    cases = [CASES["one_image"], CASES["video_then_image"], CASES["text_only"]]
    options = dict(dtype="float32", max_model_len=2048, max_num_seqs=8)
    cpu = LLM(path, device="cpu", **options)
    gpu = LLM(path, device="cuda", **options)
    expected = [o.outputs[0].token_ids for o in cpu.chat(cases, GREEDY)]
    assert [o.outputs[0].token_ids for o in gpu.chat(cases, GREEDY)] == expected
    proc, _ = process_chat(gpu, CASES["video_then_image"])
    items = [(f.modality, f.data) for f in proc.mm_features]
    items.append(("image", {**items[-1][1], "merged": False}))
    model = gpu.engine.runner.model
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            model.encode(items)
    finally:
        torch.cuda.set_sync_debug_mode("default")
