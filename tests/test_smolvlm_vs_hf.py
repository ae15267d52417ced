"""SmolVLM / SmolVLM2 and Idefics3 through the whole engine, against transformers on tiny random
checkpoints (32-pixel tiles of 16 tokens, Llama decoder, a locally trained tokenizer with the
structure tokens and SmolVLM2's chat template).

The reference's token ids come from transformers' own Idefics3Processor (images) or from the
SmolVLM processor's own constants and `_prompt_single_image` (videos: its processor needs
num2words and torchvision, absent here), its pixels from transformers' PIL image processors
(video frames: ours), with `pixel_attention_mask`. Greedy tokens identical and top
log-probabilities within 1e-3 for one image, two images with different tile grids, a video,
text only; then the engine's handling of spans whose structure tokens are not embeddings:
chunk boundaries on image and structure tokens, encoder budget and cache sized in embeddings,
encoder-cache and prefix-cache hits, the count check, and block hashes over structure tokens.
"""

from __future__ import annotations

from datetime import timedelta

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

N = 8
GREEDY = greedy(N)
LOGPROBS = greedy(N, logprobs=3)
VARIANTS = {  # name -> build_smolvlm_model options
    "smolvlm": {},
    "idefics3": {"arch": "idefics3", "longest_edge": 64},
}
IMAGE_CASES = {
    "one_image": user(random_image(90, 150, 0), "Describe the image in detail."),
    # Wide and tall: different tile grids (SmolVLM: 2 x 3 and 3 x 1).
    "two_images": user("Compare", random_image(60, 130, 1), "with", random_image(170, 50, 2),
                       "please."),
    "text_only": user("Hello there, how are you today?"),
}
VIDEO_CASE = user("What happens in", random_video(3, 40, 60, 5), "this clip?")


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    from testing.smolvlm import build_smolvlm_model

    path = build_smolvlm_model(tmp_path_factory.mktemp(request.param) / "m",
                               **VARIANTS[request.param])
    return request.param, path


@pytest.fixture(scope="module")
def smolvlm_path(tmp_path_factory):
    from testing.smolvlm import build_smolvlm_model

    return build_smolvlm_model(tmp_path_factory.mktemp("smolvlm") / "m")


def image_processor(path):
    import transformers

    arch = transformers.AutoConfig.from_pretrained(path).model_type
    cls = {"smolvlm": transformers.SmolVLMImageProcessorPil,
           "idefics3": transformers.Idefics3ImageProcessorPil}[arch]
    return cls.from_pretrained(path)


def video_text(frames: int, words: str, tile_tokens: int = 16) -> str:
    """The reference's text for a video of `frames` one-second frames (its processor's
    constants and per-frame text; num2words is not installed, `words` spells the count)."""
    from transformers.models.smolvlm import processing_smolvlm as ref

    tile = ref._prompt_single_image(
        tile_tokens, fake_token_around_image="<fake_token_around_image>", image_token="<image>",
        global_image_token="<global-img>")
    text = ref.DEFAULT_VIDEO_INTRO.format(frame_count=words,
                                          video_duration=str(timedelta(seconds=frames)))
    for second in range(frames):
        text += ref.FRAME_TIMESTAMP_MESSAGE.format(timestamp=f"00:{second:02d}") + tile
    return text + ref.DEFAULT_MEDIA_OUTTRO


def reference_inputs(path, llm, messages) -> dict:
    """transformers' inputs for `messages`, checked to be our token ids."""
    import transformers

    proc, media = process_chat(llm, messages)
    text = llm.engine.processor.render_chat(messages).text
    tok = transformers.AutoTokenizer.from_pretrained(path)
    if media.get("video"):
        ids = tok.encode(text.replace("<video>", video_text(3, "three")),
                         add_special_tokens=False)
        pixels = torch.cat([f.data["pixel_values"] for f in proc.mm_features])[None]
        inputs = {"input_ids": torch.tensor([ids]), "pixel_values": pixels,
                  "pixel_attention_mask": torch.ones(pixels.shape[:2] + pixels.shape[3:],
                                                     dtype=torch.bool)}
    elif media.get("image"):
        hf_proc = transformers.Idefics3Processor(image_processor=image_processor(path),
                                                 tokenizer=tok, image_seq_len=16)
        inputs = dict(hf_proc(text=[text], images=[media["image"]], return_tensors="pt",
                              add_special_tokens=False))
    else:
        inputs = {"input_ids": torch.tensor([tok.encode(text, add_special_tokens=False)])}
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    assert inputs["input_ids"][0].tolist() == proc.token_ids
    return inputs


@pytest.fixture(scope="module")
def refs(variant, hf_models):
    name, path = variant
    llm = LLM(path, max_model_len=2048)
    hf = hf_models(path)
    cases = dict(IMAGE_CASES, **({"video": VIDEO_CASE} if name == "smolvlm" else {}))
    out = {}
    for case, msgs in cases.items():
        inputs = reference_inputs(path, llm, msgs)
        out[case] = hf_greedy(hf, inputs, inputs["input_ids"].shape[1], N)
    return out


def test_each_case_matches_transformers(variant, refs):
    name, path = variant
    llm = LLM(path, max_model_len=2048)
    cases = dict(IMAGE_CASES, **({"video": VIDEO_CASE} if name == "smolvlm" else {}))
    outs = llm.chat(list(cases.values()), LOGPROBS)  # one batch: text-only mates included
    for case, out in zip(cases, outs, strict=True):
        assert_matches_reference(out, *refs[case], label=f"{name} {case}")
    assert_released(llm)


def test_spans_mark_image_tokens_and_keep_structure_tokens_as_text(smolvlm_path):
    llm = LLM(smolvlm_path, max_model_len=2048)
    tok = llm.engine.tokenizer
    proc, _ = process_chat(llm, IMAGE_CASES["two_images"])
    image_id = tok.convert_tokens_to_ids("<image>")
    grids = [f.data["grid"] for f in proc.mm_features]
    assert grids == [(2, 3), (3, 1)]
    for feature, (rows, cols) in zip(proc.mm_features, grids, strict=True):
        span = feature.placeholder
        ids = proc.token_ids[span.offset:span.end]
        assert span.is_embed == tuple(t == image_id for t in ids)
        assert span.num_embeds == 16 * (rows * cols + 1) < span.length
        assert tok.convert_ids_to_tokens(ids[0]) == "<fake_token_around_image>" == \
            tok.convert_ids_to_tokens(ids[-1])
        assert feature.data["pixel_values"].shape == (rows * cols + 1, 3, 32, 32)
    video, = process_chat(llm, VIDEO_CASE)[0].mm_features
    assert video.modality == "video" and video.placeholder.num_embeds == 3 * 16
    text = tok.decode(process_chat(llm, VIDEO_CASE)[0].token_ids)
    assert "\nFrame from 00:01:<fake_token_around_image><global-img>" in text


def test_pixels_equal_transformers_image_processor(tmp_path):
    import transformers

    from models.idefics3.preprocess import from_hf_dicts, preprocess_image

    sizes = [(90, 150), (170, 50), (33, 33), (7, 200), (301, 97)]
    settings = [
        (transformers.SmolVLMImageProcessorPil, {"size": {"longest_edge": 96}}),
        (transformers.Idefics3ImageProcessorPil, {"size": {"longest_edge": 140}}),
        (transformers.Idefics3ImageProcessorPil, {"size": {"longest_edge": 64},
                                                 "do_image_splitting": False}),
    ]
    for cls, options in settings:
        hf = cls(max_image_size={"longest_edge": 32}, **options)
        hf.save_pretrained(tmp_path)
        cfg = from_hf_dicts(hf.to_dict())
        for seed, (h, w) in enumerate(sizes):
            image = random_image(h, w, seed)
            ref = hf([image], return_tensors="pt", return_row_col_info=True)
            ours, rows, cols = preprocess_image(image, cfg)
            assert (rows, cols) == (ref["rows"][0][0], ref["cols"][0][0]), (cls, h, w)
            torch.testing.assert_close(ours, ref["pixel_values"][0], atol=1e-5, rtol=0)
            assert bool(ref["pixel_attention_mask"].all())


def test_video_frames_are_those_the_reference_samples(smolvlm_path):
    """Frames as SmolVLMVideoProcessor.sample_frames picks them (1 fps, at most 8 here): all
    of a short video; of a long one, 8 spread from second 1 to the last but one."""
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor
    from transformers.video_utils import VideoMetadata

    llm = LLM(smolvlm_path, max_model_len=2048)
    for frames in (3, 14):
        _, media = process_chat(llm, user(random_video(frames, 16, 24, frames), "Go."))
        meta = VideoMetadata(total_num_frames=frames, fps=1.0, duration=float(frames))
        picked = SmolVLMVideoProcessor.sample_frames(None, meta, num_frames=8, fps=1)
        assert media["video"][0].timestamps.tolist() == [float(i) for i in picked]
        assert len(picked) == min(frames, 8)
    # An encoded 14 s video at 10 fps: decoded by seeking to the reference's frame indices.
    from tests.media_fixtures import VideoSpec, encode_video, level

    data = encode_video(VideoSpec(frames=140, fps=10, width=32, height=24))
    _, media = process_chat(llm, user(data, "Go."))
    meta = VideoMetadata(total_num_frames=140, fps=10.0, duration=14.0)
    picked = SmolVLMVideoProcessor.sample_frames(None, meta, num_frames=8, fps=1)
    video = media["video"][0]
    np.testing.assert_allclose(video.timestamps, picked / 10.0, atol=1e-6)
    grey = video.frames.mean(axis=(1, 2, 3))
    assert np.abs(grey - [level(i) for i in picked]).max() < 8


def test_plans_agree_with_processing(smolvlm_path):
    """Sizes-only plans equal processing, for text prompts and for token-id prompts mixing
    images and a video."""
    llm = LLM(smolvlm_path, max_model_len=2048)
    p = llm.engine.processor
    msgs = user("See", random_image(70, 130, 3), random_video(3, 40, 60, 5), "and",
                random_image(150, 40, 4))
    parsed = p.render_chat(msgs)
    media = p.load_media_sync(parsed)
    mm = p.mm_processor
    expanded = llm.engine.tokenizer.encode(mm.expand_text(parsed.text, media, {}),
                                           add_special_tokens=False)
    raw = llm.engine.tokenizer.encode(parsed.text, add_special_tokens=False)
    for ids in (expanded, raw):
        plan = mm.plan(ids, media, {})
        out = mm.process(ids, media, {})
        assert plan.num_tokens == len(out.token_ids)
        assert plan.item_embeds == [(f.modality, f.placeholder.num_embeds)
                                    for f in out.mm_features]
        assert [f.modality for f in out.mm_features] == ["image", "video", "image"]
    assert mm.process(raw, media, {}).token_ids == expanded


def _boundary_budget(span, structure: bool) -> int:
    """A per-step token budget whose chunk boundaries (its multiples, for one request alone)
    fall inside `span` on a structure token (or on an image token)."""
    for budget in range(5, 40):
        for end in range(budget, span.end, budget):
            if span.offset < end < span.end and span.is_embed[end - span.offset] != structure:
                return budget
    raise AssertionError("no such budget")


def test_chunk_boundaries_inside_spans(smolvlm_path, hf_models):
    llm = LLM(smolvlm_path, max_model_len=2048)
    hf = hf_models(smolvlm_path)
    msgs = IMAGE_CASES["one_image"]
    inputs = reference_inputs(smolvlm_path, llm, msgs)
    tokens, logprobs = hf_greedy(hf, inputs, inputs["input_ids"].shape[1], N)
    span = process_chat(llm, msgs)[0].mm_features[0].placeholder
    for structure in (True, False):
        budget = _boundary_budget(span, structure)
        small = LLM(smolvlm_path, max_model_len=2048, max_num_batched_tokens=budget)
        assert_matches_reference(small.chat(msgs, LOGPROBS)[0], tokens, logprobs,
                                 label=f"budget {budget}")
        assert_released(small)
    # Every request of a batch cut in many places, video and text-only mates included.
    small = LLM(smolvlm_path, max_model_len=2048, max_num_batched_tokens=9, max_num_seqs=8)
    outs = small.chat([msgs, VIDEO_CASE, IMAGE_CASES["text_only"]], GREEDY)
    assert outs[0].outputs[0].token_ids == tokens
    full = LLM(smolvlm_path, max_model_len=2048).chat([VIDEO_CASE, IMAGE_CASES["text_only"]],
                                                       GREEDY)
    assert [o.outputs[0].token_ids for o in outs[1:]] == [o.outputs[0].token_ids for o in full]
    assert_released(small)


def test_encoder_budget_and_cache_count_embeddings(smolvlm_path, hf_models):
    """A 3 x 3 grid: 160 embeddings in a span of about 185 tokens runs with both the encoder's
    compute budget and its cache at exactly 160 (the largest item)."""
    msgs = user(random_image(100, 100, 7), "What is it?")
    llm = LLM(smolvlm_path, max_model_len=2048, max_num_encoder_input_tokens=160,
              encoder_cache_size=160)
    span = process_chat(llm, msgs)[0].mm_features[0].placeholder
    assert span.num_embeds == 160 < span.length
    inputs = reference_inputs(smolvlm_path, llm, msgs)
    tokens, logprobs = hf_greedy(hf_models(smolvlm_path), inputs, inputs["input_ids"].shape[1],
                                 N)
    assert_matches_reference(llm.chat(msgs, LOGPROBS)[0], tokens, logprobs)
    assert_released(llm)


def test_encoder_cache_and_prefix_cache_hits(smolvlm_path, hf_models):
    refs = {}
    for case, msgs in (("video", VIDEO_CASE), ("one_image", IMAGE_CASES["one_image"])):
        inputs = reference_inputs(smolvlm_path, LLM(smolvlm_path, max_model_len=2048), msgs)
        refs[case] = hf_greedy(hf_models(smolvlm_path), inputs, inputs["input_ids"].shape[1], N)
    llm = LLM(smolvlm_path, max_model_len=2048, enable_prefix_caching=False)
    tower = count_calls(llm.engine.runner.model.vision_model)
    llm.chat(VIDEO_CASE, GREEDY)
    again = llm.chat(VIDEO_CASE, GREEDY)[0]  # an encoder-cache hit
    assert again.outputs[0].token_ids == refs["video"][0]
    assert tower[0] == 1 and again.multi_modal_placeholders[0].cache_hit
    llm = LLM(smolvlm_path, max_model_len=2048, block_size=8)
    first = llm.chat(IMAGE_CASES["one_image"], GREEDY)[0]
    again = llm.chat(IMAGE_CASES["one_image"], GREEDY)[0]  # the image's blocks: prefix cache
    span = first.multi_modal_placeholders[0]
    assert again.num_cached_tokens > span.offset + span.length
    assert again.outputs[0].token_ids == refs["one_image"][0]
    assert_released(llm)


def test_an_encoder_output_of_the_wrong_size_names_both_counts(smolvlm_path, monkeypatch):
    llm = LLM(smolvlm_path, max_model_len=2048)
    model = llm.engine.runner.model
    encode = model.encode
    monkeypatch.setattr(model, "encode", lambda items: [e[:-1] for e in encode(items)])
    out = llm.chat(IMAGE_CASES["one_image"], GREEDY)[0]  # the step fails, the request ends
    assert out.outputs[0].finish_reason == "error"
    assert "returned 111 embeddings but its placeholder has 112 embed positions" in out.error
    assert_released(llm)


def test_block_hashes_cover_structure_tokens_of_a_span():
    """Blocks holding only a span's structure tokens (no embeddings) still carry the item's
    hash: the same token ids with other pixels never share them."""
    from engine.block_manager import BlockManager
    from engine.request import MultiModalFeature, PlaceholderRange, Request
    from engine.sampling_params import SamplingParams as Params

    tokens = [1, 2, 7, 8, 9, 9, 7, 5, 6, 10, 11, 12]  # span [2, 7): fake, row, 2 images, fake
    span = PlaceholderRange(2, 5, is_embed=(False, False, True, True, False))

    def request(rid, identifier):
        feature = MultiModalFeature("image", identifier, span)
        return Request(rid, tokens, Params(), frozenset(), 16, mm_features=[feature])

    bm = BlockManager(16, 2, enable_prefix_caching=True)  # block 1 = [fake, row]: no embeds
    cat = request("cat", "hash-cat")
    assert bm.allocate(cat, len(tokens))
    cat.num_computed_tokens = len(tokens)
    bm.cache_computed_blocks(cat, 0, len(tokens))
    assert bm.find_cached_prefix(request("dog", "hash-dog")) == cat.block_ids[:1]
    assert len(bm.find_cached_prefix(request("cat2", "hash-cat"))) > 1


def test_tower_and_connector_have_no_host_sync(smolvlm_path):
    from tests.model_fixtures import SyncRecorder

    model = LLM(smolvlm_path, max_model_len=256).engine.runner.model
    items = [("image", {"pixel_values": torch.randn(7, 3, 32, 32)}),
             ("video", {"pixel_values": torch.randn(3, 3, 32, 32)})]
    with torch.inference_mode(), SyncRecorder() as rec:
        embeds = model.encode(items)
    assert rec.seen == []
    assert [e.shape[0] for e in embeds] == [7 * 16, 3 * 16]
