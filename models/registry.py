"""Maps a checkpoint's `architectures[0]` to our model class (and its multimodal processor); a
family's modules are imported when an architecture first resolves to it."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from models.interfaces import LanguageModel, ProcessorFactory
from models.layers.decoder import CausalLM


@dataclass(frozen=True)
class ModelSpec:
    """How to build one architecture: the model class and, for multimodal models, the processor
    (built from a ProcessorContext; None for text-only models). See models/interfaces.py."""

    model: type[LanguageModel]
    processor: ProcessorFactory | None = None


@dataclass(frozen=True)
class _Family:
    """A family's spec by where its classes are (`package`.model and `package`.processor, or
    `model_module`), imported when an architecture first resolves to it: a start imports the
    family it runs, not all of them."""

    package: str
    model: str
    processor: str | None = None
    model_module: str = "model"

    def spec(self) -> ModelSpec:
        model = getattr(importlib.import_module(f"{self.package}.{self.model_module}"),
                        self.model)
        processor = None if self.processor is None else getattr(
            importlib.import_module(f"{self.package}.processor"), self.processor)
        return ModelSpec(model, processor)


_TEXT = ModelSpec(CausalLM)
_QWEN_VL = _Family("models.qwen_vl", "QwenVLForConditionalGeneration", "QwenVLProcessor")
_LLAVA = _Family("models.llava", "LlavaForConditionalGeneration", "LlavaProcessor")
_IDEFICS3 = _Family("models.idefics3", "Idefics3ForConditionalGeneration", "Idefics3Processor")
_PIXTRAL = _Family("models.mistral3", "PixtralVLM", "PixtralProcessor")
_OMNI = _Family("models.qwen_omni", "QwenOmniThinker", "QwenOmniProcessor")

_REGISTRY: dict[str, ModelSpec | _Family] = {
    "LlamaForCausalLM": _TEXT,
    "MistralForCausalLM": _TEXT,
    "Qwen2ForCausalLM": _TEXT,
    "Qwen3ForCausalLM": _TEXT,
    "Qwen3MoeForCausalLM": _TEXT,
    "Gemma3ForCausalLM": _TEXT,
    "Qwen2VLForConditionalGeneration": _QWEN_VL,
    "Qwen2_5_VLForConditionalGeneration": _QWEN_VL,
    "Qwen3VLForConditionalGeneration": _QWEN_VL,
    "Qwen3_5ForConditionalGeneration": _QWEN_VL,
    "Qwen3_5ForCausalLM": _TEXT,
    "Qwen3VLMoeForConditionalGeneration": _QWEN_VL,
    "Qwen3_5MoeForConditionalGeneration": _QWEN_VL,
    "Qwen3_5MoeForCausalLM": _TEXT,
    "Gemma3ForConditionalGeneration": _Family("models.gemma3", "Gemma3ForConditionalGeneration",
                                              "Gemma3Processor"),
    "Gemma4ForCausalLM": _Family("models.gemma4", "Gemma4ForCausalLM", model_module="text"),
    "Gemma4ForConditionalGeneration": _Family("models.gemma4", "Gemma4ForConditionalGeneration",
                                              "Gemma4Processor"),
    "LlavaForConditionalGeneration": _LLAVA,
    "LlavaNextForConditionalGeneration": _LLAVA,
    "Idefics3ForConditionalGeneration": _IDEFICS3,
    "SmolVLMForConditionalGeneration": _IDEFICS3,
    "Mistral3ForConditionalGeneration": _PIXTRAL,
    "InternVLForConditionalGeneration": _Family(
        "models.internvl", "InternVLForConditionalGeneration", "InternVLProcessor"),
    # Llama 3.2 Vision: images through cross-attention layers.
    "MllamaForConditionalGeneration": _Family(
        "models.mllama", "MllamaForConditionalGeneration", "MllamaProcessor"),
    "MiniCPMV4_6ForConditionalGeneration": _Family(
        "models.minicpmv", "MiniCPMVForConditionalGeneration", "MiniCPMVProcessor"),
    "Qwen2AudioForConditionalGeneration": _Family(
        "models.qwen2_audio", "QwenAudioForConditionalGeneration", "QwenAudioProcessor"),
    # Qwen2.5-Omni: its thinker alone, or the whole model (whose speech output is not built).
    "Qwen2_5OmniThinkerForConditionalGeneration": _OMNI,
    "Qwen2_5OmniForConditionalGeneration": _OMNI,
    "Qwen2_5OmniModel": _OMNI,
    # Phi-4-multimodal; its vision-lora / speech-lora adapter folders load with it.
    "Phi4MultimodalForCausalLM": _Family("models.phi4mm", "Phi4MMForCausalLM",
                                         "Phi4MMProcessor"),
    # Whisper (speech to text): an encoder-decoder, its decoder cross-attending to the clip.
    "WhisperForConditionalGeneration": _Family(
        "models.whisper", "WhisperForConditionalGeneration", "WhisperProcessor"),
}


# Architectures whose checkpoints come with different vision towers, by
# (architecture, vision_config.model_type): LLaVA-layout checkpoints with a Pixtral tower
# (Pixtral-12B) are Mistral 3's model without its merging projector.
_VISION_VARIANTS: dict[tuple[str, str], ModelSpec | _Family] = {
    ("LlavaForConditionalGeneration", "pixtral"): _PIXTRAL,
}


# Drafters for speculative decoding: models that cannot run alone (their attention reads their
# target's keys and values). Served as a model, such a checkpoint is refused, naming its target
# family and how to draft with it; a target checkpoint that carries drafter tensors reads past
# them.
_DRAFTERS = {"Gemma4AssistantForCausalLM": "Gemma 4"}


def register(architecture: str, spec: ModelSpec) -> None:
    _REGISTRY[architecture] = spec


def resolve(hf_config) -> ModelSpec:
    """The spec for a transformers config, or a ValueError listing what is supported."""
    archs = getattr(hf_config, "architectures", None) or []
    vision = getattr(getattr(hf_config, "vision_config", None), "model_type", None)
    for arch in archs:
        if arch in _DRAFTERS:
            raise ValueError(
                f"{arch} is a speculative-decoding drafter for {_DRAFTERS[arch]}: it reads its "
                "target's keys and values and cannot run alone; serve the target model with "
                "speculative=\"draft:PATH\" (--speculative draft:PATH) naming this checkpoint")
        if (arch, vision) in _VISION_VARIANTS:
            return _spec(_VISION_VARIANTS[arch, vision])
        if arch in _REGISTRY:
            return _spec(_REGISTRY[arch])
    raise ValueError(
        f"unsupported architecture {archs or '(none in config.json)'}; "
        f"supported: {', '.join(sorted(_REGISTRY))}"
    )


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def registered() -> dict[str, ModelSpec]:
    """Every registered architecture and its spec (every family imported)."""
    return {arch: _spec(entry) for arch, entry in _REGISTRY.items()}


def _spec(entry: ModelSpec | _Family) -> ModelSpec:
    return entry.spec() if isinstance(entry, _Family) else entry
