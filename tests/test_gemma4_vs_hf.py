"""Gemma 4 (E-size) through the whole engine, against transformers on one tiny random
Gemma4ForConditionalGeneration: 6 decoder layers (4 sliding with a 12-token window shorter than
every prompt, 2 global with their own head size and proportional RoPE), per-layer inputs, the
last two layers reading the keys and values of layers 3 and 2 (double-wide MLPs), image spans
attended both ways on the sliding layers, a vision tower with clipped linears and a standardized
output, a conformer audio encoder.

The reference gets our processed inputs (its processor cannot be built here: its video
processor needs torchvision), so our processing is checked against its parts separately: pixels
and positions against Gemma4ImageProcessorPil, features against Gemma4AudioFeatureExtractor,
the expanded prompt against the text Gemma4Processor's own replace_* methods write.
"""

from __future__ import annotations

from types import SimpleNamespace

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


def _tone(seconds: float, hz: float = 440.0) -> tuple[np.ndarray, int]:
    t = np.arange(int(seconds * 16000)) / 16000
    return (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32), 16000


CASES = {
    "text": user("The quick brown fox jumps over the lazy dog. Describe it in detail."),
    "image": user(random_image(64, 70, 0), "Describe the image in detail."),
    "two_images": user("Compare", random_image(50, 60, 1), "with", random_image(80, 40, 2)),
    "video": user(random_video(5, 40, 48, 3), "What is shown in this video?"),
    "audio": user(_tone(1.5), "Transcribe the audio clip."),
}
BUDGET_140 = {"max_soft_tokens": 140}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from testing.gemma4 import build_gemma4_model

    return build_gemma4_model(tmp_path_factory.mktemp("gemma4") / "m")


@pytest.fixture(scope="module")
def hf(path):
    import transformers

    return transformers.Gemma4ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, max_model_len=1024)


def reference(hf, llm, messages, mm_kwargs=None):
    from testing.gemma4 import hf_inputs

    proc, _ = process_chat(llm, messages, mm_kwargs)
    return hf_greedy(hf, hf_inputs(hf.config, proc), len(proc.token_ids), N)


@pytest.fixture(scope="module")
def refs(hf, llm):
    out = {case: reference(hf, llm, msgs) for case, msgs in CASES.items()}
    out["image_140"] = reference(hf, llm, CASES["image"], BUDGET_140)
    return out


def test_config_layouts_kv_sharing_and_memory(path, llm, tmp_path):
    """The Hub's config.json (global_head_dim) and transformers 5.24's (per_layer_config) give
    the same decoder; layers reading another's KV hold no cache; the per-layer table is counted
    apart and never quantized; the native decode call declines these layers."""
    import shutil

    from transformers import AutoConfig

    from models.gemma4.model import Gemma4ForConditionalGeneration
    from testing.gemma4 import to_hub_config

    hub = shutil.copytree(path, tmp_path / "hub", ignore=shutil.ignore_patterns("*.safetensors"))
    to_hub_config(hub)
    assert "global_head_dim" in (hub / "config.json").read_text()
    model = llm.engine.runner.model
    cfg = model.cfg
    with torch.device("meta"):
        other = Gemma4ForConditionalGeneration.from_hf_config(
            AutoConfig.from_pretrained(hub), 8, torch.device("meta"))
    assert other.cfg == cfg
    # Global layers: their own head size; their own KV head count only with attention_k_eq_v
    # (as transformers reads num_global_key_value_heads), which the E-size models lack.
    assert [(s.num_kv_heads, s.head_dim, s.kv_source) for s in cfg.layer_shapes] == [
        (2, 16, None), (2, 16, None), (2, 32, None), (2, 16, None), (2, 16, 3), (2, 32, 2)]
    assert cfg.mlp_size(5) == 2 * cfg.mlp_size(0)  # use_double_wide_mlp on shared layers
    layers = model.attention_layers()
    assert layers[4].kv_cache is layers[3].kv_cache and layers[5].kv_cache is layers[2].kv_cache
    assert len(llm.engine.runner.kv_caches) == 4
    bs, elem = llm.engine.runner.layout.block_size, 4
    assert llm.engine.runner.layout.bytes_per_block == 2 * bs * elem * (3 * 2 * 16 + 2 * 32)
    stats = llm.stats()
    assert stats["kv_layers"] == "4 of 6 layers (2 read another layer's)"
    assert stats["per_layer_table_bytes"] == model.per_layer_inputs.table_bytes() > 0
    # The native decode call declines these layers (it implements none of their features).
    from models.layers.native_decode import unsupported

    assert llm.engine.runner.native_decode is False
    assert "value norms are not implemented" in unsupported(model)
    assert llm.engine.runner.span_windows == (12,)  # global layers stay causal on spans
    quantized = LLM(path, max_model_len=256, quantization="int8").engine.runner.model
    assert isinstance(quantized.per_layer_inputs.embed_tokens_per_layer, torch.nn.Embedding)
    assert quantized.layers[0].per_layer_input.per_layer_input_gate.is_quantized


def test_inspect_reads_past_drafter_tensors_and_refuses_a_drafter(path, tmp_path):
    """A checkpoint carrying a drafter's tensors loads without them and the inspector says so;
    a drafter served alone is refused, naming its target (it drafts with `draft:PATH`:
    tests/test_gemma4_assistant.py)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.inspect import inspect, render
    from models.registry import resolve

    copy = shutil.copytree(path, tmp_path / "with-drafter")
    tensors = load_file(copy / "model.safetensors")
    tensors["assistant.pre_projection.weight"] = torch.zeros(4, 4)
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    report = inspect(copy)
    assert not report.unsupported
    rows = {key: value for _, key, value, _ in report.rows}
    assert rows["tensors read past"] == "assistant.* (1)"
    text = render(report)
    assert "per-layer embedding table" in text and "4 of 6 layers hold it" in text
    config = json.loads((copy / "config.json").read_text())
    drafter = SimpleNamespace(architectures=["Gemma4AssistantForCausalLM"], **{
        k: v for k, v in config.items() if k == "model_type"})
    with pytest.raises(ValueError, match="speculative-decoding drafter for Gemma 4"):
        resolve(drafter)


def test_token_id_prompts_expand_like_text(llm, refs):
    messages = CASES["image"]
    _, media = process_chat(llm, messages)
    ids = llm.engine.tokenizer.encode(llm.engine.processor.render_chat(messages).text,
                                      add_special_tokens=False)
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": media}, GREEDY)[0]
    assert out.outputs[0].token_ids == refs["image"][0]


def test_processing_matches_transformers(path, llm):
    """Pixels, positions, audio features and the expanded prompt as transformers makes them."""
    import transformers

    image_processor = transformers.Gemma4ImageProcessorPil.from_pretrained(path)
    messages = user(random_image(30, 120, 4), "and", _tone(1.2), "then",
                    random_video(3, 40, 48, 5), "end.")
    for budget in (70, 140):
        proc, media = process_chat(llm, messages, {"max_soft_tokens": budget})
        image, clip, video = media["image"][0], media["audio"][0], media["video"][0]
        ref = image_processor([image], max_soft_tokens=budget, return_tensors="pt")
        ours = proc.mm_features[0].data
        n = ours["pixel_values"].shape[0]
        assert torch.equal(ours["pixel_values"], ref["pixel_values"][0, :n])
        assert torch.equal(ours["positions"], ref["image_position_ids"][0, :n])
        assert (ref["image_position_ids"][0, n:] == -1).all()
        count = ref["num_soft_tokens_per_image"][0]
        frames = [f for f in proc.mm_features if f.modality == "video"]
        frame_ref = image_processor([transformers.image_utils.load_image(
            __import__("PIL.Image").Image.fromarray(f)) for f in video.frames],
            max_soft_tokens=budget, return_tensors="pt")
        for f, pixels in zip(frames, frame_ref["pixel_values"], strict=True):
            assert torch.equal(f.data["pixel_values"], pixels[: f.data["pixel_values"].shape[0]])
        # The prompt as Gemma4Processor writes it, from its own methods.
        features = transformers.Gemma4AudioFeatureExtractor.from_pretrained(path)(
            [clip.samples], return_tensors="np")
        audio = next(f for f in proc.mm_features if f.modality == "audio").data
        assert np.array_equal(audio["input_features"].numpy(), features["input_features"][0])
        tok = llm.engine.tokenizer
        fake = SimpleNamespace(boi_token="<|image>", eoi_token="<image|>",
                               image_token="<|image|>", video_token="<|video|>",
                               boa_token="<|audio>", eoa_token="<audio|>",
                               audio_token="<|audio|>")
        cls = transformers.Gemma4Processor
        metadata = transformers.video_utils.VideoMetadata(
            total_num_frames=len(video.frames), fps=len(video.frames) / video.duration_s,
            frames_indices=list(range(len(video.frames))))
        expected = llm.engine.processor.render_chat(messages).text
        for token, text in (
            ("<|image|>", cls.replace_image_token(fake, {"num_soft_tokens_per_image": [count]},
                                                  0)),
            ("<|audio|>", cls.replace_audio_token(
                fake, {"input_features_mask": features["input_features_mask"]}, 0)),
            ("<|video|>", cls.replace_video_token(
                fake, {"num_soft_tokens_per_video": [frames[0].placeholder.length],
                       "video_metadata": [metadata]}, 0)),
        ):
            expected = expected.replace(token, text, 1)
        assert proc.token_ids == tok.encode(expected, add_special_tokens=False), budget


def test_bidirectional_image_spans_matter(hf, llm):
    """Without mm_token_type_ids transformers attends causally inside images: different
    logits, so matching the reference exercises the spans attended both ways."""
    from testing.gemma4 import hf_inputs

    proc, _ = process_chat(llm, CASES["image"])
    assert all(f.placeholder.bidirectional for f in proc.mm_features)
    inputs = hf_inputs(hf.config, proc)
    with torch.no_grad():
        both_ways = hf(**inputs).logits
        inputs.pop("mm_token_type_ids")
        causal = hf(**inputs).logits
    assert (both_ways - causal).abs().max() > 1e-2


def test_each_case_matches_transformers(llm, refs):
    for case, msgs in CASES.items():
        out = llm.chat(msgs, LOGPROBS)[0]
        assert_matches_reference(out, *refs[case], case)
    out = llm.chat(CASES["image"], LOGPROBS, mm_processor_kwargs=BUDGET_140)[0]
    assert_matches_reference(out, *refs["image_140"], "image at 140")
    assert out.multi_modal_placeholders[0].length > 70  # the budget took
    assert_released(llm)


def test_batch_with_a_budget_that_cuts_inside_spans(path, refs):
    """80 tokens a step (each 63-64-token image span must start a chunk or fit in one), all
    cases in one batch; the encoder runs once per step for every item scheduled."""
    llm = LLM(path, max_model_len=1024, max_num_batched_tokens=80,
              max_num_encoder_input_tokens=70, max_num_seqs=8)
    assert llm.engine.processor.mm_processor.max_bidirectional_span() == 70
    outs = llm.chat(list(CASES.values()), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [refs[c][0] for c in CASES]
    assert_released(llm)


def test_encoder_cache_prefix_cache_and_preemption(path, hf, refs):
    llm = LLM(path, max_model_len=1024, enable_prefix_caching=False)
    tower = count_calls(llm.engine.runner.model.vision_tower)
    llm.chat(CASES["image"], GREEDY)
    again = llm.chat(CASES["image"], GREEDY)[0]  # encoder-cache hit
    assert again.outputs[0].token_ids == refs["image"][0]
    assert tower[0] == 1 and again.multi_modal_placeholders[0].cache_hit
    llm = LLM(path, max_model_len=1024, block_size=8)
    first = llm.chat(CASES["video"], GREEDY)[0]
    again = llm.chat(CASES["video"], GREEDY)[0]  # the frames' blocks from the prefix cache
    assert again.num_cached_tokens > first.multi_modal_placeholders[1].offset
    assert again.outputs[0].token_ids == refs["video"][0]
    assert_released(llm)
    # 12 blocks of 8 tokens cannot hold every request as it grows: the newest are preempted
    # and recomputed (layers reading another's KV included).
    prompts = [user(f"Numbers: {i} {i + 1} {i * 7}.") for i in range(6)] + [CASES["audio"]]
    expected = [reference(hf, llm, m)[0] for m in prompts[:-1]] + [refs["audio"][0]]
    per_block = llm.engine.runner.layout.bytes_per_block
    llm = LLM(path, max_model_len=96, block_size=8, kv_cache_bytes=12 * per_block,
              max_num_seqs=8)
    outs = llm.chat(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert_released(llm)


def test_budget_and_clip_limits_are_named(llm):
    with pytest.raises(ValueError, match=r"max_soft_tokens=100 is not one of 70, 140, 280"):
        llm.chat(CASES["image"], GREEDY, mm_processor_kwargs={"max_soft_tokens": 100})
    out = llm.chat(CASES["video"], GREEDY, mm_processor_kwargs={"num_frames": 2})[0]
    assert [p.part for p in out.multi_modal_placeholders] == [
        "frame 00:00, budget 70", "frame 00:00, budget 70"]
    assert llm.chat(CASES["image"], GREEDY)[0].multi_modal_placeholders[0].part == "budget 70"
    with pytest.raises(ValueError, match="longer than Gemma 4's 30 s window"):
        llm.chat(user(_tone(31.0), "Hi"), GREEDY)
    assert_released(llm)
