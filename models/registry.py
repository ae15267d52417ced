"""Maps a checkpoint's `architectures[0]` to our model class (and its multimodal processor)."""

from __future__ import annotations

from dataclasses import dataclass

from models.decoder import CausalLM
from models.qwen2_audio import QwenAudioForConditionalGeneration
from models.qwen2_audio_processor import QwenAudioProcessor
from models.qwen2_vl import QwenVLForConditionalGeneration
from models.qwen2_vl_processor import QwenVLProcessor


@dataclass(frozen=True)
class ModelSpec:
    """How to build one architecture: the module class and, for multimodal models, the processor.

    `processor` is None for text-only models; otherwise a class constructed with
    (hf_config, tokenizer, model_path, model_id, engine_config) that expands placeholders and
    prepares encoder inputs. It checks its `mm_processor_kwargs` against declared ranges
    (engine.mm_options) and, where it can tell the expanded prompt from the items' sizes alone,
    offers `plan(token_ids, media, mm_kwargs) -> PromptPlan`, so that the engine refuses an
    oversized prompt before any encoder input is allocated.
    """

    model: type
    processor: type | None = None


_REGISTRY: dict[str, ModelSpec] = {
    "LlamaForCausalLM": ModelSpec(CausalLM),
    "MistralForCausalLM": ModelSpec(CausalLM),
    "Qwen2ForCausalLM": ModelSpec(CausalLM),
    "Qwen2VLForConditionalGeneration": ModelSpec(QwenVLForConditionalGeneration, QwenVLProcessor),
    "Qwen2_5_VLForConditionalGeneration": ModelSpec(
        QwenVLForConditionalGeneration, QwenVLProcessor
    ),
    "Qwen2AudioForConditionalGeneration": ModelSpec(
        QwenAudioForConditionalGeneration, QwenAudioProcessor
    ),
}


def register(architecture: str, spec: ModelSpec) -> None:
    _REGISTRY[architecture] = spec


def resolve(hf_config) -> ModelSpec:
    """The spec for a transformers config, or a ValueError listing what is supported."""
    archs = getattr(hf_config, "architectures", None) or []
    for arch in archs:
        if arch in _REGISTRY:
            return _REGISTRY[arch]
    raise ValueError(
        f"unsupported architecture {archs or '(none in config.json)'}; "
        f"supported: {', '.join(sorted(_REGISTRY))}"
    )


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)
