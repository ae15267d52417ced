"""Gemma 3 with vision through the whole engine, against transformers on a tiny random
Gemma3ForConditionalGeneration (6 layers, 5 local : 1 global, a 12-token window shorter than
every prompt, SigLIP tower, 16 tokens per image attended both ways).

The reference gets its inputs from transformers' own Gemma3Processor (token ids, pixels,
`token_type_ids` for the bidirectional image mask), so our expansion, pan-and-scan crops and
preprocessing are checked as well as the model: token ids equal, greedy tokens identical, top
log-probabilities within tolerance, for one image, two images, pan-and-scan crops, text only, a
budget that would cut an image, an encoder-cache hit and a prefix-cache hit after an image.
"""

from __future__ import annotations

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
)

N = 8
GREEDY = greedy(N)
PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 20,
                "pan_and_scan_max_num_crops": 3, "pan_and_scan_min_ratio_to_activate": 1.4}


def chat(*parts, system: str | None = None) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p}
               for p in parts]
    head = [{"role": "system", "content": system}] if system else []
    return head + [{"role": "user", "content": content}]


CASES = {
    "one_image": chat(random_image(64, 70, 0), "Describe the image in detail.",
                      system="Be brief."),
    "two_images": chat("Compare", random_image(50, 60, 1), "with", random_image(80, 76, 2),
                        "please."),
    "pan_and_scan": chat(random_image(40, 130, 3), "What is in the wide picture?"),
    "text_only": chat("Hello there, how are you today?"),
}


@pytest.fixture(scope="module")
def gemma_path(tmp_path_factory):
    from testing.gemma3 import build_gemma3_model

    return build_gemma3_model(tmp_path_factory.mktemp("gemma3") / "m", pan_and_scan=PAN_AND_SCAN)


@pytest.fixture(scope="module")
def hf_processor(gemma_path):
    import transformers

    return transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil.from_pretrained(gemma_path),
        tokenizer=transformers.AutoTokenizer.from_pretrained(gemma_path),
        image_seq_length=16,
    )


def reference(hf, hf_processor, llm, messages):
    """transformers' expansion, greedy tokens and per-step log-probabilities."""
    proc, media = process_chat(llm, messages, PAN_AND_SCAN)
    text = llm.engine.processor.render_chat(messages).text
    images = media.get("image") or None
    # transformers' Gemma3Processor overrides the image processor's pan-and-scan settings with
    # its own defaults (off) unless the call passes them; ours does the same (per request).
    inputs = hf_processor(text=[text], images=[images] if images else None,
                          return_tensors="pt", add_special_tokens=False, **PAN_AND_SCAN)
    inputs.pop("num_crops", None)
    assert inputs["input_ids"][0].tolist() == proc.token_ids
    return (*hf_greedy(hf, inputs, len(proc.token_ids), N), inputs)


@pytest.fixture(scope="module")
def refs(gemma_path, hf_models, hf_processor):
    llm = LLM(gemma_path, max_model_len=1024)
    hf = hf_models(gemma_path)
    return {case: reference(hf, hf_processor, llm, msgs) for case, msgs in CASES.items()}


def test_expansion_spans_and_the_bidirectional_mask_matter(gemma_path, refs, hf_models):
    llm = LLM(gemma_path, max_model_len=1024)
    proc, _ = process_chat(llm, CASES["pan_and_scan"], PAN_AND_SCAN)
    spans = [f.placeholder for f in proc.mm_features]
    assert len(spans) == 1 + 3  # the image and its three crops, each its own item
    assert all(s.length == 16 and s.bidirectional for s in spans)
    assert llm.engine.processor.mm_processor.max_bidirectional_span() == 16
    # Without token_type_ids transformers attends causally inside images: different logits,
    # so matching the reference really exercises the bidirectional spans.
    hf = hf_models(gemma_path)
    inputs = dict(refs["one_image"][2])
    with torch.no_grad():
        both_ways = hf(**inputs).logits
        inputs.pop("token_type_ids")
        causal = hf(**inputs).logits
    assert (both_ways - causal).abs().max() > 1e-2


def test_each_case_matches_transformers(gemma_path, refs):
    llm = LLM(gemma_path, max_model_len=1024)
    params = greedy(N, logprobs=3)
    for case, msgs in CASES.items():
        out = llm.chat(msgs, params, mm_processor_kwargs=PAN_AND_SCAN)[0]
        assert_matches_reference(out, *refs[case][:2], case)
    assert_released(llm)


def test_batch_with_a_budget_that_would_cut_images(gemma_path, refs):
    """20 tokens a step: every 16-token span must start a chunk or fit in one, never be cut."""
    llm = LLM(gemma_path, max_model_len=1024, max_num_batched_tokens=20, max_num_seqs=8)
    tower = count_calls(llm.engine.runner.model.vision_tower)
    outs = llm.chat(list(CASES.values()), GREEDY, mm_processor_kwargs=PAN_AND_SCAN)
    assert [o.outputs[0].token_ids for o in outs] == [refs[c][0] for c in CASES]
    assert tower[0] >= 1
    assert_released(llm)


def test_encoder_cache_and_prefix_cache_hits(gemma_path, refs):
    llm = LLM(gemma_path, max_model_len=1024, enable_prefix_caching=False)
    tower = count_calls(llm.engine.runner.model.vision_tower)
    llm.chat(CASES["one_image"], GREEDY)
    again = llm.chat(CASES["one_image"], GREEDY)[0]  # encoder-cache hit
    assert again.outputs[0].token_ids == refs["one_image"][0]
    assert tower[0] == 1 and again.multi_modal_placeholders[0].cache_hit
    llm = LLM(gemma_path, max_model_len=1024, block_size=8)
    first = llm.chat(CASES["one_image"], GREEDY)[0]
    again = llm.chat(CASES["one_image"], GREEDY)[0]  # the image's blocks from the prefix cache
    assert again.num_cached_tokens > first.multi_modal_placeholders[0].offset + 16
    assert again.outputs[0].token_ids == refs["one_image"][0]
    assert_released(llm)


def test_pan_and_scan_is_per_request_as_in_transformers(gemma_path):
    """The checkpoint's image processor says do_pan_and_scan (testing.gemma3 saves it so), but
    transformers' Gemma3Processor passes its own default (off) on every call: so do we, and a
    request turns it on."""
    llm = LLM(gemma_path, max_model_len=1024)
    msgs = CASES["pan_and_scan"]
    assert len(llm.chat(msgs, GREEDY)[0].multi_modal_placeholders) == 1
    out = llm.chat(msgs, GREEDY, mm_processor_kwargs=PAN_AND_SCAN)[0]
    assert len(out.multi_modal_placeholders) == 4
    with pytest.raises(ValueError, match="pan_and_scan_max_num_crops must be in"):
        llm.chat(msgs, GREEDY, mm_processor_kwargs={"pan_and_scan_max_num_crops": 99})


def test_startup_refuses_a_budget_below_an_image(gemma_path):
    with pytest.raises(ValueError, match="up to 16 tokens.*max_num_batched_tokens is 8"):
        LLM(gemma_path, max_model_len=1024, max_num_batched_tokens=8)


def test_text_only_system_prompt_and_eos(gemma_path):
    llm = LLM(gemma_path, max_model_len=1024)
    text = llm.engine.processor.render_chat(chat("Hi", system="Be brief.")).text
    assert text.startswith("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>")
    tok = llm.engine.tokenizer
    assert tok.convert_tokens_to_ids("<end_of_turn>") in llm.engine.eos_token_ids
