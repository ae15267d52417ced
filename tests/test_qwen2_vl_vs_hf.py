"""Images and videos through the whole engine, matched against transformers, for Qwen2-VL and
Qwen2.5-VL: greedy tokens identical and prefill logits within tolerance, with chunked prefill
across a span, encoder-cache hits and evictions, prefix-cache hits, batched encoders, preemption
after prefill (media encoded again), and every cache reference released at the end."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from engine import LLM, SamplingParams
from models.processing import qwen_items  # where the Qwen-VL processor prepares pixels
from tests.helpers import (
    assert_released,
    assert_top_logprobs,
    count_calls,
    greedy,
    hf_greedy,
    process_chat,
    random_image,
    random_video,
    user,
)

N = 10
GREEDY = greedy(N)


CASES = {
    "one_image": user(random_image(120, 200, 0), "Describe the image in detail."),
    "two_images": user("Compare", random_image(64, 64, 1), "with", random_image(200, 90, 2),
                       "please."),
    "video": user(random_video(4, 56, 84, 3), "What is shown in this video?"),
    "image_and_video": user(random_image(80, 80, 4), random_video(3, 56, 56, 5), "What changed?"),
    "text_only": user("Hello there, how are you today?"),
}


def processed(llm: LLM, messages):
    proc, media = process_chat(llm, messages)
    proc.videos = media.get("video", [])  # the reference needs each video's sampling rate
    return proc


def hf_inputs(hf, proc) -> dict:
    """transformers' inputs for our processed prompt: one pixel tensor and grid per image, and
    per video (our features split a video into temporal patches; concatenated back here)."""
    ids = torch.tensor([proc.token_ids])
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "mm_token_type_ids": (ids == hf.config.image_token_id).int()
              + 2 * (ids == hf.config.video_token_id).int()}
    images = [f.data for f in proc.mm_features if f.modality == "image"]
    if images:
        kwargs["pixel_values"] = torch.cat([d["pixel_values"] for d in images])
        kwargs["image_grid_thw"] = torch.tensor([d["grid_thw"] for d in images])
    videos: dict[str, list] = {}
    for f in proc.mm_features:
        if f.modality == "video":
            videos.setdefault(f.identifier.rsplit(":t", 1)[0], []).append(f.data)
    if videos:
        parts = list(videos.values())
        kwargs["pixel_values_videos"] = torch.cat([d["pixel_values"] for p in parts for d in p])
        kwargs["video_grid_thw"] = torch.tensor(
            [(len(p), *p[0]["grid_thw"][1:]) for p in parts])
        if hf.config.model_type == "qwen2_5_vl":
            kwargs["second_per_grid_ts"] = torch.tensor(
                [2 / v.sampled_fps for v in proc.videos], dtype=torch.float32)
    return kwargs


@contextlib.contextmanager
def trained_rope(hf, proc):
    """Have transformers use the mRoPE positions the checkpoints were trained with.

    transformers 5.23 places text after a video whose time extent exceeds its grid inside the
    video's time range (tests/test_mrope.py pins this and checks our positions against an
    independent transcription of the trained rule); everything else stays transformers' own.
    """
    original = hf.model.get_rope_index

    def positions(input_ids, *args, **kwargs):
        window = proc.position_info.window(0, input_ids.shape[1])  # [3, L]
        return window[:, None, :], torch.tensor([[proc.position_info.delta]])

    hf.model.get_rope_index = positions
    try:
        yield
    finally:
        hf.model.get_rope_index = original


def hf_tokens(hf, proc, n: int = N) -> list[int]:
    """transformers' greedy tokens (hf_greedy) for the prompt the engine processed, with the
    positions it was trained with (trained_rope)."""
    kwargs = hf_inputs(hf, proc)
    with trained_rope(hf, proc):
        return hf_greedy(hf, kwargs, len(proc.token_ids), n)[0]


@pytest.fixture(scope="module")
def refs(vl_path, hf_models):
    """transformers' greedy continuation of every case (processed by a throwaway engine)."""
    llm = LLM(vl_path, max_model_len=1024)
    hf = hf_models(vl_path)
    return {name: hf_tokens(hf, processed(llm, msgs)) for name, msgs in CASES.items()}


def _all_cases(llm: LLM) -> dict[str, list[int]]:
    outs = llm.chat(list(CASES.values()), GREEDY)
    return {name: o.outputs[0].token_ids for name, o in zip(CASES, outs, strict=True)}


def test_each_case_alone_matches(vl_path, refs):
    llm = LLM(vl_path, max_model_len=1024)
    for name, msgs in CASES.items():
        out = llm.chat(msgs, GREEDY)[0]
        assert out.outputs[0].token_ids == refs[name], name
    assert_released(llm)


def test_batch_of_multimodal_requests_matches(vl_path, refs):
    llm = LLM(vl_path, max_model_len=1024)
    assert _all_cases(llm) == refs
    assert_released(llm)


def test_span_split_across_prefill_chunks(vl_path, refs):
    """A 16-token budget is smaller than every image: spans are computed over several steps."""
    llm = LLM(vl_path, max_model_len=1024, max_num_batched_tokens=16)
    assert _all_cases(llm) == refs
    assert_released(llm)


def test_prefill_logits_match(vl_path, hf_models):
    llm = LLM(vl_path, max_model_len=1024, max_num_batched_tokens=24)
    hf = hf_models(vl_path)
    msgs = CASES["image_and_video"]
    params = greedy(3, logprobs=5)
    out = llm.chat(msgs, params)[0].outputs[0]
    proc = processed(llm, msgs)
    kwargs = hf_inputs(hf, proc)
    ids = torch.tensor([proc.token_ids + out.token_ids[:-1]])
    kwargs.update(input_ids=ids, attention_mask=torch.ones_like(ids),
                  mm_token_type_ids=torch.nn.functional.pad(kwargs["mm_token_type_ids"], (0, 2)))
    with torch.no_grad(), trained_rope(hf, proc):
        ref = hf(**kwargs).logits[0, len(proc.token_ids) - 1 :].log_softmax(-1)
    assert_top_logprobs(out.logprobs, ref, k=5)


def test_encoder_cache_hit_skips_the_encoder(vl_path, hf_models):
    llm = LLM(vl_path, max_model_len=1024, enable_prefix_caching=False)
    hf = hf_models(vl_path)
    calls = count_calls(llm.engine.runner.model.visual)
    picture = random_image(120, 200, 7)
    first = llm.chat(user(picture, "Describe the image."), GREEDY)[0]
    assert calls == [1] and first.multi_modal_placeholders[0].cache_hit is False
    second_msgs = user(picture, "What colour dominates this picture?")
    second = llm.chat(second_msgs, GREEDY)[0]
    assert calls == [1], "the encoder ran again for a cached image"
    assert second.multi_modal_placeholders[0].cache_hit is True
    assert second.metrics.encoder_cache_hits == 1 and second.metrics.encoder_calls == 0
    assert second.outputs[0].token_ids == hf_tokens(hf, processed(llm, second_msgs))
    assert llm.engine.processor.mm_processor.cache.hits >= 1  # preprocessing skipped too
    assert_released(llm)


def test_tiny_encoder_cache_evicts_and_stays_correct(vl_path, refs):
    """A cache that holds one image's embeddings at a time: entries are evicted between uses."""
    llm = LLM(vl_path, max_model_len=1024, encoder_cache_size=64,
              max_num_encoder_input_tokens=64)
    assert _all_cases(llm) == refs
    assert _all_cases(llm) == refs  # the second round hits some entries, recomputes evicted ones
    assert_released(llm)


def test_prefix_cache_hits_on_image_prompts(vl_path, refs):
    llm = LLM(vl_path, max_model_len=1024)
    msgs = CASES["two_images"]
    assert llm.chat(msgs, GREEDY)[0].outputs[0].token_ids == refs["two_images"]
    again = llm.chat(msgs, GREEDY)[0]
    # Whole blocks and then the last block's tail: everything but the last token.
    assert again.num_cached_tokens == len(again.prompt_token_ids) - 1
    assert again.outputs[0].token_ids == refs["two_images"]
    assert again.metrics.encoder_calls == 0  # all spans came from the KV cache
    assert_released(llm)


def test_a_second_turn_about_the_image_computes_only_the_new_text(vl_path, hf_models):
    """The conversation so far (the image, a question, the reply) comes from the first turn's
    KV, its last partly filled block copied token by token; tokens are transformers' on the
    whole conversation (mRoPE positions after the image included)."""
    llm = LLM(vl_path, max_model_len=1024)
    hf = hf_models(vl_path)
    first_turn = user(random_image(64, 48, 21), "Describe.")
    first = llm.chat(first_turn, GREEDY)[0]
    history = first_turn + [{"role": "assistant", "content": first.outputs[0].text},
                            {"role": "user", "content": "And the colours?"}]
    second = llm.chat(history, GREEDY)[0]
    assert second.num_cached_tokens >= len(first.prompt_token_ids)
    assert second.num_cached_tokens % 16 and second.metrics.encoder_calls == 0
    assert second.outputs[0].token_ids == hf_tokens(hf, processed(llm, history))
    assert_released(llm)


def test_same_text_different_image_never_shares_kv(vl_path, hf_models):
    llm = LLM(vl_path, max_model_len=1024)
    hf = hf_models(vl_path)
    a, b = user(random_image(64, 64, 11), "Describe."), user(random_image(64, 64, 12), "Describe.")
    llm.chat(a, GREEDY)
    out = llm.chat(b, GREEDY)[0]
    span = out.multi_modal_placeholders[0]
    assert out.num_cached_tokens <= span.offset  # nothing past the image's start was reused
    assert out.outputs[0].token_ids == hf_tokens(hf, processed(llm, b))


def test_long_video_encoder_work_is_spread_over_prefill_chunks(vl_path, hf_models):
    """Each temporal patch of a video is its own encoder item: with small chunks, the encoder
    runs a few patches per step alongside the chunk that needs them, never the whole video."""
    llm = LLM(vl_path, max_model_len=1024, max_num_batched_tokens=24)
    calls = count_calls(llm.engine.runner.model.visual)
    msgs = user("Watch this:", random_video(16, 56, 112, 40), "What happens?")
    out = llm.chat(msgs, GREEDY)[0]
    spans = out.multi_modal_placeholders
    assert len(spans) == 8 and all(s.modality == "video" for s in spans)  # 16 frames, 2 per patch
    assert [s.offset for s in spans] == [spans[0].offset + i * spans[0].length for i in range(8)]
    assert calls[0] >= 4 and out.metrics.encoder_calls == calls[0]
    # Most of these steps sample nothing; their times (encoder included) are still measured.
    m = out.metrics
    prefill_seconds = sum(seconds for _, seconds in m.prefill_chunks)
    assert 0 < m.encoder_time < prefill_seconds
    assert out.outputs[0].token_ids == hf_tokens(hf_models(vl_path), processed(llm, msgs))


def test_four_images_in_one_step_are_one_encoder_forward(qwen2_vl_path):
    llm = LLM(qwen2_vl_path, max_model_len=1024)
    calls = count_calls(llm.engine.runner.model.visual)
    prompts = [user(random_image(60 + 10 * i, 90, 20 + i), f"Image {i}?") for i in range(4)]
    outs = llm.chat(prompts, GREEDY)
    assert calls == [1]
    assert all(o.metrics.encoder_calls == 1 for o in outs)
    assert_released(llm)


def test_abort_releases_cache_references(qwen2_vl_path):
    llm = LLM(qwen2_vl_path, max_model_len=1024, max_num_batched_tokens=16)
    engine = llm.engine
    p = engine.processor
    for i in range(3):
        parsed = p.render_chat(user(random_image(100, 100, 30 + i), "Describe."))
        req = engine.make_request(p.process(parsed, p.load_media_sync(parsed)),
                                  SamplingParams(max_tokens=50, ignore_eos=True), f"r{i}")
        engine.add_request(req)
    for _ in range(3):
        engine.step()
    assert engine.stats()["encoder_cache_referenced"] > 0
    for i in range(3):
        engine.abort_request(f"r{i}")
    assert_released(llm)


def test_placeholder_typed_without_media_is_a_clear_error(qwen2_vl_path):
    llm = LLM(qwen2_vl_path, max_model_len=1024)
    prompt = "<|vision_start|><|image_pad|><|vision_end|> what is this?"
    with pytest.raises(ValueError, match="1 image placeholder.*but 0 image"):
        llm.generate(prompt, GREEDY)
    with pytest.raises(ValueError, match="0 image placeholder.*but 1 image"):
        llm.generate({"prompt": "no placeholder",
                      "multi_modal_data": {"image": random_image(8, 8, 0)}})
    assert llm.generate("plain text still works", GREEDY)[0].outputs[0].finish_reason == "length"


def test_item_larger_than_the_encoder_budget_is_refused(qwen2_vl_path, monkeypatch):
    with pytest.raises(ValueError, match="raise encoder_cache_size to at least 64"):
        LLM(qwen2_vl_path, encoder_cache_size=32)
    # The checkpoint's max_pixels allows 64 embeddings; a per-request override may raise it
    # to the encoder budget (100 embeddings of 28x28 pixels), not past it.
    llm = LLM(qwen2_vl_path, max_model_len=1024, encoder_cache_size=100)
    with pytest.raises(ValueError, match=r"mm_processor_kwargs max_pixels=7840000 is not an "
                       r"integer in \[784, 78400\]"):
        llm.chat(user(random_image(500, 500, 0), "hi"), GREEDY,
                 mm_processor_kwargs={"max_pixels": 28 * 28 * 10000})
    out = llm.chat(user(random_image(500, 500, 0), "hi"), GREEDY,
                   mm_processor_kwargs={"max_pixels": 28 * 28 * 100})[0]
    assert 64 < out.multi_modal_placeholders[0].length <= 100
    # The encoder-budget check stays behind the option ranges, before any pixel is prepared.
    processor = llm.engine.processor
    parsed = processor.render_chat(user(random_image(500, 500, 0), "hi"),
                                   mm_processor_kwargs={"max_pixels": 28 * 28 * 100})
    media = processor.load_media_sync(parsed)
    budget = processor.encoder_budget
    processor.encoder_budget = dataclasses.replace(budget, max_embeds=64)

    def never(*args, **kwargs):
        raise AssertionError("pixels were prepared for a prompt that is refused")

    monkeypatch.setattr(qwen_items, "preprocess_image", never)
    with pytest.raises(ValueError, match=r"image needs \d+ embeddings, more than the encoder "
                       r"budget of 64 \(encoder_cache_size\)"):
        processor.process(parsed, media)
    monkeypatch.undo()
    processor.encoder_budget = budget
    out = llm.chat(user(random_image(50, 50, 0), "hi"), GREEDY)[0]
    assert out.outputs[0].finish_reason == "length"


def test_preempted_requests_encode_their_media_again(vl_path, hf_models):
    """Room for two of six image prompts and an encoder cache of one image, no prefix cache:
    requests are preempted after their first tokens and their embeddings evicted by the next
    request's image; on recompute the encoder runs again on the inputs the request kept."""
    per_block = 2 * 2 * 2 * 16 * 16 * 4  # layers, K and V, kv heads, head dim, block, fp32
    llm = LLM(vl_path, max_model_len=256, kv_cache_bytes=16 * per_block,
              enable_prefix_caching=False, encoder_cache_size=64,
              max_num_encoder_input_tokens=64)
    chats = [user(random_image(168, 224, 20 + i), "Describe the image.") for i in range(6)]
    outs = llm.chat(chats, dataclasses.replace(GREEDY, max_tokens=30))  # decodes past a block
    hf = hf_models(vl_path)
    assert [o.outputs[0].token_ids for o in outs] == [
        hf_tokens(hf, processed(llm, msgs), 30) for msgs in chats]
    again = [o for o in outs if o.metrics.num_preemptions and o.metrics.encoder_calls > 1]
    assert again, "no request was preempted and encoded again"
    assert_released(llm)
