"""Every family read from both checkpoint layouts the Hub holds, against transformers.

Each tiny checkpoint is written by transformers' own `save_pretrained` (model, tokenizer and
processor) with processor settings away from their class defaults (sizes, pinpoints,
max_image_size, min/max pixels, image_seq_length, the mel bins) and with the LM head tied or
not; the legacy layout is the same checkpoint rewritten as older transformers releases wrote it
(testing/layouts.py: component files beside a flat processor_config.json, the chat template in
tokenizer_config.json or chat_template.json, torch_dtype). For each, transformers' own processor
(AutoProcessor, or its image processor where the full processor needs torchvision) loads the
checkpoint from disk as a user's would, and our prompt ids, pixel values (or mel features) and
greedy tokens must equal its; text-only families are checked the same way for the template, dtype
and tie. Add a layout or a family: add it here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM
from testing.layouts import to_legacy_layout
from tests.helpers import greedy, hf_greedy, process_chat, random_image

N = 4
GREEDY = greedy(N)
LAYOUTS = {
    "transformers5": None,
    "legacy-tokenizer-template": "tokenizer_config.json",
    "legacy-chat-template-json": "chat_template.json",
}


@dataclass(frozen=True)
class Family:
    build: Callable[[Path, bool], Path]  # (path, tie_word_embeddings) -> checkpoint
    media: Callable[[], dict]  # a content part with the family's media
    reference: Callable[[Path, str, list, object], dict]  # HF inputs (path, text, media, tok)
    features: str = "pixel_values"  # the processed input compared with transformers'
    ties: bool = True  # whether transformers' class ties the head when the flag says so
    # Hooks that make the reference compute what we serve, where the two differ on purpose
    # (Mllama's rows before the first image: testing.mllama.zero_text_rows).
    patch_reference: Callable[[object], object] | None = None


def _image() -> dict:
    return {"type": "image", "image": random_image(70, 90, 1)}


def _audio() -> dict:
    t = np.arange(24000) / 16000
    wave = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    return {"type": "input_audio", "input_audio": _wav(wave)}


def _wav(wave: np.ndarray) -> dict:
    import base64
    import io

    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, wave, 16000, format="WAV")
    return {"data": base64.b64encode(buf.getvalue()).decode(), "format": "wav"}


def _auto_processor(path, text, media, tokenizer):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    return dict(processor(text=[text], images=media or None, return_tensors="pt",
                          add_special_tokens=False))


def _gemma(path, text, media, tokenizer):
    inputs = _auto_processor(path, text, media, tokenizer)
    inputs.pop("num_crops", None)
    return inputs


def _gemma4(path, text, media, tokenizer):
    """Gemma4Processor needs torchvision (its video processor): its image processor is loaded
    from the checkpoint as a user's would be, and each image's placeholder written out by the
    processor class's own method; one image needs no patch padding."""
    from types import SimpleNamespace

    import transformers

    pixels = transformers.AutoImageProcessor.from_pretrained(path)(
        images=media, return_tensors="pt")
    fake = SimpleNamespace(boi_token="<|image>", eoi_token="<image|>", image_token="<|image|>")
    parts = text.split("<|image|>")
    text = parts[0] + "".join(transformers.Gemma4Processor.replace_image_token(fake, pixels, i)
                              + p for i, p in enumerate(parts[1:]))
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    n = int((pixels["image_position_ids"][0] >= 0).all(-1).sum())
    image_id = tokenizer.convert_tokens_to_ids("<|image|>")
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
            "mm_token_type_ids": (ids == image_id).long(),
            "pixel_values": pixels["pixel_values"][:, :n],
            "image_position_ids": pixels["image_position_ids"][:, :n]}


def _pixtral(path, text, media, tokenizer):
    from testing.mistral3 import pixtral_processor_class

    processor = pixtral_processor_class().from_pretrained(path)
    return dict(processor(text=[text], images=media, return_tensors="pt",
                          add_special_tokens=False))


def _smolvlm(path, text, media, tokenizer):
    """SmolVLMProcessor needs torchvision (its video processor); for images it writes what
    Idefics3Processor writes, over the checkpoint's own image processor and fields."""
    import json

    import transformers

    image_processor = transformers.AutoImageProcessor.from_pretrained(path)
    fields = json.loads((path / "processor_config.json").read_text())
    processor = transformers.Idefics3Processor(
        image_processor=image_processor, tokenizer=tokenizer,
        image_seq_len=fields["image_seq_len"])
    return dict(processor(text=[text], images=[media], return_tensors="pt",
                          add_special_tokens=False))


def _internvl(path, text, media, tokenizer):
    """InternVLProcessor needs torchvision (its video processor): it is assembled over the
    checkpoint's image processor, tokenizer and fields (testing.internvl.reference_processor)."""
    from testing.internvl import reference_processor

    return dict(reference_processor(path)(text=[text], images=media, return_tensors="pt",
                                          add_special_tokens=False))


def _minicpmv(path, text, media, tokenizer):
    """MiniCPMV4_6Processor as from_pretrained builds it (testing.minicpmv: its video
    processor's class needs torchvision only to resize frames)."""
    from testing.minicpmv import load_hf_processor

    return dict(load_hf_processor(path)(text=[text], images=media, return_tensors="pt"))


def _qwen_vl(path, text, media, tokenizer):
    """Qwen-VL processors need torchvision (their video processors); the image processor is
    loaded from the checkpoint as AutoImageProcessor finds it, and each image's pad token
    expanded to its grid's merged patches as the processor does."""
    import transformers

    image_processor = transformers.AutoImageProcessor.from_pretrained(path)
    pixels = image_processor(images=media, return_tensors="pt")
    merge = image_processor.merge_size ** 2
    counts = iter(int(g.prod()) // merge for g in pixels["image_grid_thw"])
    parts = text.split("<|image_pad|>")
    text = parts[0] + "".join("<|image_pad|>" * next(counts) + p for p in parts[1:])
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **pixels,
            "mm_token_type_ids": (ids == image_id).long()}


def _qwen_audio(path, text, media, tokenizer):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    return dict(processor(text=[text], audio=[c.samples for c in media],
                          sampling_rate=16000, return_tensors="pt"))


def _omni(path, text, media, tokenizer):
    """Qwen2_5OmniProcessor needs torchvision (its video processor): its image processor and
    feature extractor are loaded from the checkpoint as a user's would be, and each placeholder
    expanded as the processor does (an image's merged patches; a clip's encoder outputs)."""
    import transformers
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import (
        _get_feat_extract_output_lengths,
    )

    if isinstance(media[0], np.ndarray) or hasattr(media[0], "samples"):
        extractor = transformers.WhisperFeatureExtractor.from_pretrained(path)
        mel = extractor([c.samples for c in media], sampling_rate=16000, padding="max_length",
                        return_attention_mask=True, return_tensors="pt")
        counts = iter(_get_feat_extract_output_lengths(mel["attention_mask"].sum(-1)).tolist())
        inputs = {"input_features": mel["input_features"],
                  "feature_attention_mask": mel["attention_mask"]}
        token = "<|AUDIO|>"
    else:
        inputs = dict(transformers.AutoImageProcessor.from_pretrained(path)(
            images=media, return_tensors="pt"))
        counts = iter(int(g.prod()) // 4 for g in inputs["image_grid_thw"])
        token = "<|IMAGE|>"
    parts = text.split(token)
    text = parts[0] + "".join(token * next(counts) + p for p in parts[1:])
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **inputs}


def _phi4mm(path, text, media, tokenizer):
    """Phi4MultimodalProcessor needs torchvision (its image processor): its feature extractor
    is loaded from the checkpoint as a user's would be, and each `<|audio|>` expanded to the
    clip's embed size as the processor does."""
    import transformers

    extractor = transformers.Phi4MultimodalFeatureExtractor.from_pretrained(path)
    features = extractor([c.samples for c in media], sampling_rate=16000, return_tensors="pt")
    counts = iter(features["audio_embed_sizes"].tolist())
    parts = text.split("<|audio|>")
    text = parts[0] + "".join("<|audio|>" * next(counts) + p for p in parts[1:])
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **features}


def _phi4mm_reference(path):
    """transformers' model with the checkpoint's speech adapter (what an audio request uses),
    loaded by PEFT."""
    import transformers
    from peft import PeftModel

    hf = transformers.Phi4MultimodalForCausalLM.from_pretrained(path, dtype=torch.float32)
    return PeftModel.from_pretrained(hf, path / "speech-lora").eval()


def _llava(next_: bool = False, tower: str = "clip"):
    from testing.llava import build_llava_model

    return lambda p, tie: build_llava_model(p, next_=next_, tower=tower, num_layers=1,
                                            tie_word_embeddings=tie)


TINY_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}


def _families() -> dict[str, Family]:
    from testing.gemma3 import build_gemma3_model
    from testing.gemma4 import build_gemma4_model
    from testing.internvl import build_internvl_model, rename_to_transformers5_keys
    from testing.minicpmv import build_minicpmv_model
    from testing.mistral3 import build_mistral3_model
    from testing.mllama import build_mllama_model, zero_text_rows
    from testing.phi4mm import build_phi4mm_model
    from testing.qwen3_5 import build_qwen3_5_model
    from testing.qwen3_vl import build_qwen3_vl_model
    from testing.qwen_omni import build_qwen_omni_model
    from testing.smolvlm import build_smolvlm_model
    from testing.tiny import build_qwen2_audio_model, build_qwen2_vl_model

    return {
        "llava": Family(_llava(), _image, _auto_processor),
        "llava-siglip": Family(_llava(tower="siglip"), _image, _auto_processor),
        "llava-next": Family(_llava(next_=True), _image, _auto_processor),
        "gemma3": Family(lambda p, tie: build_gemma3_model(p, tie_word_embeddings=tie), _image,
                         _gemma),
        "gemma4": Family(lambda p, tie: build_gemma4_model(p, tie_word_embeddings=tie,
                                                           audio=False), _image, _gemma4),
        "idefics3": Family(lambda p, tie: build_smolvlm_model(
            p, arch="idefics3", tie_word_embeddings=tie), _image, _auto_processor),
        "smolvlm": Family(lambda p, tie: build_smolvlm_model(p, tie_word_embeddings=tie),
                          _image, _smolvlm),
        # Weights under the Hub's names (what save_pretrained writes), and under the names
        # transformers 5's class holds them by.
        "internvl": Family(lambda p, tie: build_internvl_model(
            p, min_patches=2, max_patches=4, tie_word_embeddings=tie), _image, _internvl),
        "internvl-model-keys": Family(lambda p, tie: rename_to_transformers5_keys(
            build_internvl_model(p, text="qwen3", tie_word_embeddings=tie)), _image, _internvl),
        "mistral3": Family(lambda p, tie: build_mistral3_model(p, tie_word_embeddings=tie),
                           _image, _pixtral),
        # Llama 3.2 Vision: tiles, aspect ratio ids and the cross-attention mask from its
        # processor; transformers' class never ties the head.
        "mllama": Family(lambda p, tie: build_mllama_model(p, tie_word_embeddings=tie), _image,
                         _auto_processor, ties=False, patch_reference=zero_text_rows),
        "minicpmv": Family(lambda p, tie: build_minicpmv_model(p, tie_word_embeddings=tie),
                           _image, _minicpmv),
        "qwen2_vl": Family(lambda p, tie: build_qwen2_vl_model(p, tie_word_embeddings=tie),
                           _image, _qwen_vl),
        "qwen2_5_vl": Family(lambda p, tie: build_qwen2_vl_model(
            p, "qwen2_5_vl", tie_word_embeddings=tie), _image, _qwen_vl),
        "qwen3_vl": Family(lambda p, tie: build_qwen3_vl_model(p, tie_word_embeddings=tie),
                           _image, _qwen_vl),
        "qwen3_5": Family(lambda p, tie: build_qwen3_5_model(p, tie_word_embeddings=tie),
                          _image, _qwen_vl),
        "qwen3_vl_moe": Family(lambda p, tie: build_qwen3_vl_model(
            p, tie_word_embeddings=tie, experts=TINY_EXPERTS), _image, _qwen_vl),
        "qwen3_5_moe": Family(lambda p, tie: build_qwen3_5_model(
            p, tie_word_embeddings=tie,
            experts={**TINY_EXPERTS, "shared_expert_intermediate_size": 32}), _image, _qwen_vl),
        "qwen2_audio": Family(lambda p, tie: build_qwen2_audio_model(
            p, tie_word_embeddings=tie), _audio, _qwen_audio, "input_features", ties=False),
        # The thinker saved alone, heard; the whole Omni model (the Hub's layout), seeing.
        "qwen_omni-thinker": Family(lambda p, tie: build_qwen_omni_model(
            p, tie_word_embeddings=tie), _audio, _omni, "input_features"),
        "qwen_omni": Family(lambda p, tie: build_qwen_omni_model(
            p, layout="omni", tie_word_embeddings=tie), _image, _omni),
        # Heard: transformers' image processor needs torchvision, its feature extractor not.
        "phi4mm": Family(lambda p, tie: build_phi4mm_model(p, tie_word_embeddings=tie), _audio,
                         _phi4mm, "audio_input_features"),
    }


FAMILIES = _families()
CASES = [(f, layout, tie) for f in FAMILIES for layout in LAYOUTS for tie in (False, True)
         if (layout == "transformers5") or tie == (layout == "legacy-tokenizer-template")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One checkpoint per (family, tie), built once; each layout is a rewritten copy."""
    import shutil

    built: dict[tuple[str, bool], Path] = {}

    def get(family: str, layout: str, tie: bool) -> Path:
        if (family, tie) not in built:
            root = tmp_path_factory.mktemp(f"{family}-{'tied' if tie else 'untied'}")
            built[family, tie] = FAMILIES[family].build(root / "t5", tie)
        path = built[family, tie]
        if LAYOUTS[layout] is None:
            return path
        copy = path.parent / layout
        if not copy.exists():
            shutil.copytree(path, copy)
            to_legacy_layout(copy, LAYOUTS[layout])
        return copy

    return get


@pytest.mark.parametrize(("family", "layout", "tie"), CASES,
                         ids=[f"{f}-{lay}-{'tied' if t else 'untied'}" for f, lay, t in CASES])
def test_ours_equals_transformers(checkpoints, family, layout, tie):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    spec = FAMILIES[family]
    path = checkpoints(family, layout, tie)
    _check_layout(path, layout)
    llm = LLM(path, max_model_len=1024)
    messages = [{"role": "user", "content": [spec.media(), {"type": "text", "text": "Hi!"}]}]
    proc, media = process_chat(llm, messages)
    text = llm.engine.processor.render_chat(messages).text
    tokenizer = AutoTokenizer.from_pretrained(path)
    items = next(iter(media.values()))
    ref = spec.reference(path, text, items, tokenizer)
    assert ref["input_ids"][0].tolist() == proc.token_ids, "prompt ids"
    ours = torch.cat([f.data[spec.features].reshape(-1) for f in proc.mm_features])
    theirs = ref[spec.features]
    if spec.features == "input_features":  # transformers pads every clip to the 30 s window
        frames = proc.mm_features[0].data[spec.features].shape[-1]
        theirs = theirs[..., :frames]
    torch.testing.assert_close(ours, theirs.reshape(-1).float(), atol=1e-5, rtol=1e-5)
    if family == "qwen2_audio":
        import transformers

        hf = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(
            path, dtype=torch.float32).eval()
    elif family.startswith("qwen_omni"):
        import transformers

        hf = (transformers.Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(
            path, dtype=torch.float32) if family == "qwen_omni-thinker" else
            transformers.Qwen2_5OmniForConditionalGeneration.from_pretrained(
                path, dtype=torch.float32, enable_audio_output=False).thinker).eval()
    elif family == "phi4mm":
        hf = _phi4mm_reference(path)
    else:
        hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    if spec.patch_reference is not None:
        spec.patch_reference(hf)
    hf_tied = hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    assert hf_tied == (tie and spec.ties)  # the checkpoint is what the case says
    assert llm.engine.runner.model.cfg.tie_word_embeddings == hf_tied
    tokens, _ = hf_greedy(hf, ref, len(proc.token_ids), N)
    assert llm.chat(messages, GREEDY)[0].outputs[0].token_ids == tokens


def _check_layout(path: Path, layout: str) -> None:
    """The rewritten layout really is what it claims (so the test reads what it says)."""
    import json

    processor = json.loads((path / "processor_config.json").read_text())
    nested = any(k in processor for k in ("image_processor", "feature_extractor"))
    if layout == "transformers5":
        assert nested and (path / "chat_template.jinja").exists()
        assert not (path / "preprocessor_config.json").exists()
        return
    assert not nested and (path / "preprocessor_config.json").exists()
    assert not (path / "chat_template.jinja").exists()
    if layout == "legacy-chat-template-json":
        assert (path / "chat_template.json").exists()
    else:
        assert "chat_template" in json.loads((path / "tokenizer_config.json").read_text())
    assert "torch_dtype" in json.loads((path / "config.json").read_text())


TEXT_CASES = [(f, layout, tie)
              for f in ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma3_text",
                        "qwen3_5_text", "gemma4_text")
              for layout in ("transformers5", "legacy-tokenizer-template")
              for tie in (False, True)]


@pytest.mark.parametrize(("family", "layout", "tie"), TEXT_CASES,
                         ids=[f"{f}-{lay}-{'tied' if t else 'untied'}"
                              for f, lay, t in TEXT_CASES])
def test_text_families_in_both_layouts(tmp_path, family, layout, tie):
    """Text-only checkpoints: the chat template in chat_template.jinja or tokenizer_config.json,
    dtype or torch_dtype, the head tied by the config's own flag."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from testing.qwen3_5 import build_qwen3_5_text_model
    from testing.tiny import build_text_model

    if family == "qwen3_5_text":  # hybrid: Gated DeltaNet and attention layers
        path = build_qwen3_5_text_model(tmp_path / "m", tie_word_embeddings=tie)
    elif family == "gemma4_text":  # per-layer inputs, KV sharing; the Hub's config.json
        from testing.gemma4 import build_gemma4_model

        path = build_gemma4_model(tmp_path / "m", text_only=True, tie_word_embeddings=tie,
                                  config_layout="hub" if tie else "transformers5")
    else:
        overrides = {"head_dim": 16, "query_pre_attn_scalar": 16} \
            if family == "gemma3_text" else {}
        if family == "qwen3_moe":
            overrides = {**TINY_EXPERTS, "norm_topk_prob": True}
        path = build_text_model(tmp_path / "m", family, num_layers=1, tie_word_embeddings=tie,
                                config_overrides=overrides)
    if LAYOUTS[layout] is not None:
        to_legacy_layout(path, LAYOUTS[layout])
    assert (path / "chat_template.jinja").exists() == (layout == "transformers5")
    llm = LLM(path, max_model_len=256)
    messages = [{"role": "user", "content": "Hello there!"}]
    text = llm.engine.processor.render_chat(messages).text
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert text == tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_tied = hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    assert hf_tied == tie == llm.engine.runner.model.cfg.tie_word_embeddings
    tokens, _ = hf_greedy(hf, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                          ids.shape[1], N)
    assert llm.chat(messages, GREEDY)[0].outputs[0].token_ids == tokens
