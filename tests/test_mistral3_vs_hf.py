"""Mistral Small 3.1 (Mistral3ForConditionalGeneration) through the whole engine, against
transformers on a tiny random checkpoint: pixels equal to PixtralImageProcessorPil's, prompts
equal to PixtralProcessor's (one span per image, `is_embed` over its `[IMG]` tokens only),
greedy tokens identical and top log-probabilities within tolerance for one image, two images
with different row counts, text-only batch mates, chunk boundaries inside spans and exactly on
`[IMG_BREAK]`, encoder-cache and prefix-cache hits; LLaVA with a Pixtral tower (Pixtral-12B's
layout) once. The reference always gets `image_sizes`, so it crops as it should.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from engine import LLM
from tests.helpers import (
    assert_matches_reference,
    assert_released,
    count_calls,
    greedy,
    hf_greedy,
    process_chat,
    random_image,
    user,
)

N = 6
GREEDY = greedy(N)
WITH_LOGPROBS = greedy(N, logprobs=3)
CASES = {
    "one_image": user(random_image(90, 150, 0), "Describe the image in detail."),
    # 3 x 5 and (scaled down to fit 168) 6 x 2 embeddings: different row counts.
    "two_images": user("Compare", random_image(60, 130, 1), "with", random_image(170, 50, 2),
                       "please."),
    "text_only": user("Hello there, how are you today?"),
}


@pytest.fixture(scope="module")
def m3_path(tmp_path_factory):
    from testing.mistral3 import build_mistral3_model

    return build_mistral3_model(tmp_path_factory.mktemp("mistral3") / "m")


def hf_inputs(path, llm, messages, merge: int = 2) -> tuple[dict, list[int]]:
    """transformers' PixtralProcessor's inputs for `messages` (from the chat template's text)
    and our processed token ids."""
    from testing.mistral3 import hf_pixtral_processor

    proc, media = process_chat(llm, messages)
    text = llm.engine.tokenizer.apply_chat_template(messages, tokenize=False)
    images = media.get("image") or None
    kwargs = dict(hf_pixtral_processor(path, merge)(text=[text], images=images,
                                                    return_tensors="pt"))
    return kwargs, proc.token_ids


@pytest.fixture(scope="module")
def refs(m3_path, hf_models):
    llm = LLM(m3_path, max_model_len=1024)
    hf = hf_models(m3_path)
    out = {}
    for case, msgs in CASES.items():
        kwargs, ids = hf_inputs(m3_path, llm, msgs)
        assert ("image_sizes" in kwargs) == (case != "text_only")
        out[case] = hf_greedy(hf, kwargs, len(ids), N)
    return out


def test_pixels_match_transformers():
    import transformers

    from models.mistral3.preprocess import PixtralPreprocessConfig, preprocess_pixtral

    hf = transformers.PixtralImageProcessorPil(size={"longest_edge": 168},
                                               patch_size={"height": 28, "width": 28})
    cfg = PixtralPreprocessConfig.from_hf(hf.to_dict())
    rgba = Image.new("RGBA", (75, 40), (200, 30, 90, 100))
    images = [random_image(h, w, s) for s, (h, w) in
              enumerate([(90, 150), (170, 50), (400, 90), (28, 28), (10, 300), (168, 169)])]
    for img in [*images, rgba, images[0].convert("L")]:
        ref = hf(images=[img], return_tensors="pt")
        ours = preprocess_pixtral(img, cfg, 28)
        assert list(ours.shape[1:]) == ref["image_sizes"][0].tolist(), img.size
        torch.testing.assert_close(ours, ref["pixel_values"][0], atol=1e-5, rtol=0)


def test_prompts_match_transformers_processor(m3_path):
    llm = LLM(m3_path, max_model_len=1024)
    tok = llm.engine.tokenizer
    img, brk, end = tok.convert_tokens_to_ids(["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
    mm = llm.engine.processor.mm_processor
    for case, msgs in CASES.items():
        kwargs, ids = hf_inputs(m3_path, llm, msgs)
        assert ids == kwargs["input_ids"][0].tolist(), case
        proc, media = process_chat(llm, msgs)
        spans = [f.placeholder for f in proc.mm_features]
        assert len(spans) == len(media.get("image", [])) == ids.count(end)
        for span, (h, w) in zip(spans, kwargs.get("image_sizes", []), strict=True):
            rows, cols = h.item() // 28, w.item() // 28
            run = ids[span.offset : span.end]
            assert run == ([img] * cols + [brk]) * (rows - 1) + [img] * cols + [end]
            assert span.is_embed == tuple(t == img for t in run)
            assert span.num_embeds == rows * cols
        plan = mm.plan([t for t in ids if t not in (img, brk, end)] + [img] * len(spans),
                       media, {})
        assert plan.num_tokens == len(ids)
        assert plan.item_embeds == [("image", s.num_embeds) for s in spans]
    rows = [f.placeholder.length - f.placeholder.num_embeds
            for f in process_chat(llm, CASES["two_images"])[0].mm_features]
    assert rows == [3, 6]


def test_each_case_matches_transformers(m3_path, refs):
    llm = LLM(m3_path, max_model_len=1024)
    for case, msgs in CASES.items():
        assert_matches_reference(llm.chat(msgs, WITH_LOGPROBS)[0], *refs[case], case)
    assert_released(llm)


def test_batch_one_tower_forward_encoder_cache_counts_embeds(m3_path, refs):
    # No prefix caching: the repeated image must come from the encoder cache, not the KV cache.
    llm = LLM(m3_path, max_model_len=1024, max_num_seqs=8, enable_prefix_caching=False)
    tower = count_calls(llm.engine.runner.model.vision_tower)
    outs = llm.chat(list(CASES.values()), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [refs[c][0] for c in CASES]
    assert tower[0] == 1  # three images of two requests, one tower forward
    spans = [p for o in outs for p in o.multi_modal_placeholders]
    # The cache holds embeddings, not span positions (breaks take none).
    assert llm.stats()["encoder_cache_used"] == sum(p.num_embeds for p in spans)
    assert sum(p.num_embeds for p in spans) < sum(p.length for p in spans)
    brk, end = llm.engine.tokenizer.convert_tokens_to_ids(["[IMG_BREAK]", "[IMG_END]"])
    for out in outs:  # the UI is told where the row breaks and the end token sit
        for p in out.multi_modal_placeholders:
            inside = [out.prompt_token_ids[p.offset + k] for k in p.text_offsets]
            assert len(inside) == p.length - p.num_embeds and inside[-1] == end
            assert set(inside[:-1]) <= {brk}
    again = llm.chat(CASES["one_image"], GREEDY)[0]  # the same pixels: an encoder-cache hit
    assert again.outputs[0].token_ids == refs["one_image"][0]
    assert tower[0] == 1 and again.multi_modal_placeholders[0].cache_hit
    assert_released(llm)


def _break_positions(llm, case: str) -> list[int]:
    proc, _ = process_chat(llm, CASES[case])
    span = proc.mm_features[0].placeholder
    return [span.offset + i for i, e in enumerate(span.is_embed) if not e]


def record_chunk_starts(llm) -> list[int]:
    """The start of every chunk `llm` schedules from now on."""
    scheduler, starts = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def recording():
        out = schedule()
        starts.extend(c.start for c in out.chunks)
        return out

    scheduler.schedule = recording
    return starts


def test_chunk_boundaries_on_breaks_and_inside_rows(m3_path, refs):
    probe = LLM(m3_path, max_model_len=1024)
    first_break = _break_positions(probe, "one_image")[0]
    # Chunks of B tokens: B = first_break starts the second chunk ON the first [IMG_BREAK],
    # B + 1 starts it right after, 5 cuts inside rows.
    for budget in (first_break, first_break + 1, 5):
        llm = LLM(m3_path, max_model_len=1024, max_num_batched_tokens=budget,
                  enable_prefix_caching=False)
        starts = record_chunk_starts(llm)
        out = llm.chat(CASES["one_image"], GREEDY)[0]
        assert out.outputs[0].token_ids == refs["one_image"][0], budget
        assert budget in starts
        assert_released(llm)
    # A mixed batch in 10-token steps: every span is cut, requests share steps.
    llm = LLM(m3_path, max_model_len=1024, max_num_batched_tokens=10, max_num_seqs=8)
    outs = llm.chat(list(CASES.values()), GREEDY)
    assert all(p.length > 10 for o in outs for p in o.multi_modal_placeholders)
    assert [o.outputs[0].token_ids for o in outs] == [refs[c][0] for c in CASES]
    assert_released(llm)


def test_prefix_cache_hits_only_for_the_same_pixels(m3_path, refs):
    llm = LLM(m3_path, max_model_len=1024, block_size=8)
    first = llm.chat(CASES["one_image"], GREEDY)[0]
    again = llm.chat(CASES["one_image"], GREEDY)[0]
    span = first.multi_modal_placeholders[0]
    assert again.num_cached_tokens > span.offset + span.length
    assert again.outputs[0].token_ids == refs["one_image"][0]
    # Same size, other pixels: the same token ids, but no KV block past the span's start.
    other = llm.chat(user(random_image(90, 150, 9), "Describe the image in detail."), GREEDY)[0]
    assert other.prompt_token_ids == first.prompt_token_ids
    assert other.num_cached_tokens <= span.offset
    assert_released(llm)


def test_encoder_count_mismatch_names_both_numbers(m3_path):
    from engine.request import Request
    from engine.scheduler import SchedulerOutput

    llm = LLM(m3_path, max_model_len=1024)
    runner = llm.engine.runner
    proc, _ = process_chat(llm, CASES["one_image"])
    feature = proc.mm_features[0]
    encode = runner.model.encode
    runner.model.encode = lambda items: [e[:-1] for e in encode(items)]
    req = Request("r", proc.token_ids, GREEDY, frozenset(), 4, mm_features=[feature])
    n = feature.placeholder.num_embeds
    with pytest.raises(RuntimeError, match=f"returned {n - 1} embeddings .* {n} embed positions"):
        runner._run_encoders(SchedulerOutput(encoder_inputs=[(req, 0)]))


def test_llava_with_a_pixtral_tower_matches_transformers(tmp_path):
    import transformers

    from models.mistral3.model import PixtralVLM
    from testing.mistral3 import build_mistral3_model

    path = build_mistral3_model(tmp_path / "llava_pixtral", llava=True)
    llm = LLM(path, max_model_len=1024)
    assert isinstance(llm.engine.runner.model, PixtralVLM)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    for case in ("one_image", "two_images"):
        kwargs, ids = hf_inputs(path, llm, CASES[case], merge=1)
        assert ids == kwargs["input_ids"][0].tolist(), case
        ref = hf_greedy(hf.eval(), kwargs, len(ids), N)
        assert_matches_reference(llm.chat(CASES[case], WITH_LOGPROBS)[0], *ref, case)
    assert_released(llm)


def test_tower_and_splice_with_breaks_have_no_host_sync(m3_path):
    """The Pixtral tower over two images of different sizes (block-diagonal, one forward), the
    projector, and a splice cut inside a span: no host sync; the breaks keep their token
    embeddings and the [IMG] positions take the image's embeddings in order."""
    from engine.request import Request
    from engine.scheduler import ScheduledChunk
    from models.encoders.pixtral import build_pixtral_batch
    from tests.model_fixtures import SyncRecorder

    llm = LLM(m3_path, max_model_len=1024)
    runner, model = llm.engine.runner, llm.engine.runner.model
    proc, _ = process_chat(llm, CASES["two_images"])
    pixels = [f.data["pixel_values"] for f in proc.mm_features]
    batch = build_pixtral_batch(pixels, 14, 2, torch.device("cpu"), torch.float32)  # host side
    with torch.inference_mode(), SyncRecorder() as rec:
        merged = model.multi_modal_projector(model.vision_tower(batch, model.feature_layers))
    assert rec.seen == [] and len(set(batch.sizes)) == 2
    with torch.inference_mode():
        alone = model.encode([("image", f.data) for f in proc.mm_features[1:]])[0]
    # Batched and alone, the tower's linears run at other row counts, whose planned GEMMs may
    # sum in another order (the plan is measured, so the order differs between machines and
    # loads): float32 rounding of sums of a few hundred terms, relative to values up to about 5
    # (an image's embeddings out of order would differ by about their size).
    torch.testing.assert_close(merged[-alone.shape[0]:], alone, atol=5e-5, rtol=1e-4)

    feature = proc.mm_features[0]
    span = feature.placeholder
    runner.encoder_outputs[feature.identifier] = merged[: span.num_embeds]
    req = Request("r", proc.token_ids, GREEDY, frozenset(), 4, mm_features=[feature])
    end = span.offset + span.length - 3  # inside the span, past several breaks
    ids = torch.tensor(proc.token_ids[:end])
    with torch.inference_mode(), SyncRecorder() as rec:
        embeds, _ = runner._splice_embeddings(ids, [ScheduledChunk(req, 0, end)])
    assert rec.seen == []
    with torch.inference_mode():
        text = model.embed(ids)
    mask = torch.zeros(end, dtype=torch.bool)
    mask[span.offset : end] = torch.tensor(span.is_embed[: end - span.offset])
    torch.testing.assert_close(embeds[~mask], text[~mask])
    torch.testing.assert_close(embeds[mask], merged[: span.embeds_before(end)])


def test_inner_feature_layers_match_transformers(tmp_path):
    """vision_feature_layer other than the last: an inner block (Mistral 3), and the embeddings
    (index 0) with an inner block concatenated (LLaVA-Pixtral), for two images of different
    sizes, against transformers' image features."""
    import transformers

    from testing.mistral3 import build_mistral3_model

    for name, options, merge in (("m3", {"feature_layer": -2}, 2),
                                 ("llava", {"feature_layer": [0, -2], "llava": True}, 1)):
        path = build_mistral3_model(tmp_path / name, vision_depth=3, **options)
        llm = LLM(path, max_model_len=1024)
        kwargs, _ = hf_inputs(path, llm, CASES["two_images"], merge)
        hf = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            ref = hf.eval().model.get_image_features(
                pixel_values=kwargs["pixel_values"], image_sizes=kwargs["image_sizes"],
            ).pooler_output
        proc, _ = process_chat(llm, CASES["two_images"])
        with torch.inference_mode():
            ours = llm.engine.runner.model.encode([("image", f.data) for f in proc.mm_features])
        for a, b in zip(ours, ref, strict=True):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_bfloat16_tracks_transformers_in_bfloat16(m3_path):
    import transformers

    llm = LLM(m3_path, dtype="bfloat16", max_model_len=1024)
    hf = transformers.AutoModelForImageTextToText.from_pretrained(m3_path, dtype=torch.bfloat16)
    kwargs, ids = hf_inputs(m3_path, llm, CASES["two_images"])
    kwargs["pixel_values"] = kwargs["pixel_values"].to(torch.bfloat16)
    tokens, logprobs = hf_greedy(hf.eval(), kwargs, len(ids), N)
    params = greedy(N, logprobs=1)
    out = llm.chat(CASES["two_images"], params)[0].outputs[0]
    # bfloat16 rounds differently in the two implementations (fused projections, float32
    # rotary); the tiny random models amplify it: the first tokens agree and, while the
    # tokens agree, the chosen token's log-probability stays within 0.25 of the reference's.
    assert out.token_ids[:2] == tokens[:2]
    for step, (token, entry) in enumerate(zip(tokens, out.logprobs, strict=False)):
        if out.token_ids[: step + 1] != tokens[: step + 1]:
            break
        assert abs(entry[token] - logprobs[step, token].item()) < 0.25, step


def test_encoder_budgets_count_embeds_not_span_positions(m3_path):
    """The largest image (6 x 6 embeddings, a 42-token span with its breaks) fits budgets of
    exactly 36 embeddings, in chunks shorter than its span; 35 is refused at start-up."""
    msgs = user(random_image(168, 168, 4), "What is it?")
    llm = LLM(m3_path, max_model_len=1024, encoder_cache_size=36,
              max_num_encoder_input_tokens=36, max_num_batched_tokens=16)
    span = llm.chat(msgs, GREEDY)[0].multi_modal_placeholders[0]
    assert (span.num_embeds, span.length) == (36, 42)
    assert llm.stats()["encoder_cache_used"] == 36
    assert_released(llm)
    with pytest.raises(ValueError, match="needs 36 embeddings.*allows 35"):
        LLM(m3_path, max_model_len=1024, encoder_cache_size=35)
