"""Maps a checkpoint's `architectures[0]` to our model class (and its multimodal processor)."""

from __future__ import annotations

from dataclasses import dataclass

from models.gemma3.model import Gemma3ForConditionalGeneration
from models.gemma3.processor import Gemma3Processor
from models.gemma4.model import Gemma4ForConditionalGeneration
from models.gemma4.processor import Gemma4Processor
from models.gemma4.text import Gemma4ForCausalLM
from models.idefics3.model import Idefics3ForConditionalGeneration
from models.idefics3.processor import Idefics3Processor
from models.interfaces import LanguageModel, ProcessorFactory
from models.internvl.model import InternVLForConditionalGeneration
from models.internvl.processor import InternVLProcessor
from models.layers.decoder import CausalLM
from models.llava.model import LlavaForConditionalGeneration
from models.llava.processor import LlavaProcessor
from models.minicpmv.model import MiniCPMVForConditionalGeneration
from models.minicpmv.processor import MiniCPMVProcessor
from models.mistral3.model import PixtralVLM
from models.mistral3.processor import PixtralProcessor
from models.mllama.model import MllamaForConditionalGeneration
from models.mllama.processor import MllamaProcessor
from models.phi4mm.model import Phi4MMForCausalLM
from models.phi4mm.processor import Phi4MMProcessor
from models.qwen2_audio.model import QwenAudioForConditionalGeneration
from models.qwen2_audio.processor import QwenAudioProcessor
from models.qwen_omni.model import QwenOmniThinker
from models.qwen_omni.processor import QwenOmniProcessor
from models.qwen_vl.model import QwenVLForConditionalGeneration
from models.qwen_vl.processor import QwenVLProcessor
from models.whisper.model import WhisperForConditionalGeneration
from models.whisper.processor import WhisperProcessor


@dataclass(frozen=True)
class ModelSpec:
    """How to build one architecture: the model class and, for multimodal models, the processor
    (built from a ProcessorContext; None for text-only models). See models/interfaces.py."""

    model: type[LanguageModel]
    processor: ProcessorFactory | None = None


_REGISTRY: dict[str, ModelSpec] = {
    "LlamaForCausalLM": ModelSpec(CausalLM),
    "MistralForCausalLM": ModelSpec(CausalLM),
    "Qwen2ForCausalLM": ModelSpec(CausalLM),
    "Qwen3ForCausalLM": ModelSpec(CausalLM),
    "Qwen3MoeForCausalLM": ModelSpec(CausalLM),
    "Gemma3ForCausalLM": ModelSpec(CausalLM),
    "Qwen2VLForConditionalGeneration": ModelSpec(QwenVLForConditionalGeneration, QwenVLProcessor),
    "Qwen2_5_VLForConditionalGeneration": ModelSpec(
        QwenVLForConditionalGeneration, QwenVLProcessor
    ),
    "Qwen3VLForConditionalGeneration": ModelSpec(QwenVLForConditionalGeneration, QwenVLProcessor),
    "Qwen3_5ForConditionalGeneration": ModelSpec(QwenVLForConditionalGeneration, QwenVLProcessor),
    "Qwen3_5ForCausalLM": ModelSpec(CausalLM),
    "Qwen3VLMoeForConditionalGeneration": ModelSpec(
        QwenVLForConditionalGeneration, QwenVLProcessor
    ),
    "Qwen3_5MoeForConditionalGeneration": ModelSpec(
        QwenVLForConditionalGeneration, QwenVLProcessor
    ),
    "Qwen3_5MoeForCausalLM": ModelSpec(CausalLM),
    "Gemma3ForConditionalGeneration": ModelSpec(Gemma3ForConditionalGeneration, Gemma3Processor),
    "Gemma4ForCausalLM": ModelSpec(Gemma4ForCausalLM),
    "Gemma4ForConditionalGeneration": ModelSpec(Gemma4ForConditionalGeneration,
                                                 Gemma4Processor),
    "LlavaForConditionalGeneration": ModelSpec(LlavaForConditionalGeneration, LlavaProcessor),
    "LlavaNextForConditionalGeneration": ModelSpec(
        LlavaForConditionalGeneration, LlavaProcessor
    ),
    "Idefics3ForConditionalGeneration": ModelSpec(
        Idefics3ForConditionalGeneration, Idefics3Processor
    ),
    "SmolVLMForConditionalGeneration": ModelSpec(
        Idefics3ForConditionalGeneration, Idefics3Processor
    ),
    "Mistral3ForConditionalGeneration": ModelSpec(PixtralVLM, PixtralProcessor),
    "InternVLForConditionalGeneration": ModelSpec(
        InternVLForConditionalGeneration, InternVLProcessor
    ),
    # Llama 3.2 Vision: images through cross-attention layers.
    "MllamaForConditionalGeneration": ModelSpec(
        MllamaForConditionalGeneration, MllamaProcessor
    ),
    "MiniCPMV4_6ForConditionalGeneration": ModelSpec(
        MiniCPMVForConditionalGeneration, MiniCPMVProcessor
    ),
    "Qwen2AudioForConditionalGeneration": ModelSpec(
        QwenAudioForConditionalGeneration, QwenAudioProcessor
    ),
    # Qwen2.5-Omni: its thinker alone, or the whole model (whose speech output is not built).
    "Qwen2_5OmniThinkerForConditionalGeneration": ModelSpec(QwenOmniThinker, QwenOmniProcessor),
    "Qwen2_5OmniForConditionalGeneration": ModelSpec(QwenOmniThinker, QwenOmniProcessor),
    "Qwen2_5OmniModel": ModelSpec(QwenOmniThinker, QwenOmniProcessor),
    # Phi-4-multimodal; its vision-lora / speech-lora adapter folders load with it.
    "Phi4MultimodalForCausalLM": ModelSpec(Phi4MMForCausalLM, Phi4MMProcessor),
    # Whisper (speech to text): an encoder-decoder, its decoder cross-attending to the clip.
    "WhisperForConditionalGeneration": ModelSpec(WhisperForConditionalGeneration,
                                                 WhisperProcessor),
}


# Architectures whose checkpoints come with different vision towers, by
# (architecture, vision_config.model_type): LLaVA-layout checkpoints with a Pixtral tower
# (Pixtral-12B) are Mistral 3's model without its merging projector.
_VISION_VARIANTS: dict[tuple[str, str], ModelSpec] = {
    ("LlavaForConditionalGeneration", "pixtral"): ModelSpec(PixtralVLM, PixtralProcessor),
}


# Drafters for speculative decoding: models that cannot run alone (their attention reads their
# target's keys and values). Speculative decoding is not built: such a checkpoint is refused,
# naming its target family; a target checkpoint that carries drafter tensors reads past them.
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
                "target's keys and values and cannot run alone; serve the target model "
                "(its assistant drafter is not built)")
        if (arch, vision) in _VISION_VARIANTS:
            return _VISION_VARIANTS[arch, vision]
        if arch in _REGISTRY:
            return _REGISTRY[arch]
    raise ValueError(
        f"unsupported architecture {archs or '(none in config.json)'}; "
        f"supported: {', '.join(sorted(_REGISTRY))}"
    )


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def registered() -> dict[str, ModelSpec]:
    """Every registered architecture and its spec."""
    return dict(_REGISTRY)
