"""Phi-4-multimodal (Phi4MultimodalForCausalLM): a Phi-3 style decoder (fused qkv and gate-up
projections, partial rotary embeddings with longrope's scaling) fed by two encoders, the SigLIP
tower on dynamic-HD crops (models/phi4mm/vision.py) and the conformer audio encoder
(models/encoders/conformer.py) with its projections.

The checkpoint ships LoRA adapters for the decoder beside its weights, one per modality, in PEFT
folders (`vision-lora`, `speech-lora`): requests with images compute with the vision adapter,
requests with audio (and no image) with the speech adapter, text-only requests with neither
(`modality_adapters`; the engine applies them per request: models/layers/lora.py). Audio is
projected by one of two projections: the "vision" one when its request also has images, the
"speech" one otherwise; the processor records which in each clip's encoder inputs (and in its
content hash).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from models.encoders.conformer import ConformerConfig, ConformerEncoder
from models.interfaces import EncoderItem
from models.kernels.linear import EncoderLinear
from models.layers.attention import LayerAttention
from models.layers.decoder import Decoder, DecoderConfig
from models.layers.decoder_config import layer_attention_from_hf, layer_rope_from_hf
from models.layers.rotary import longrope_attention_factor
from models.layers.transfer import to_device
from models.phi4mm.vision import ImageEmbedding

PROJECTIONS = ("speech", "vision")  # the audio projection modes


class AudioEmbedding(nn.Module):
    """The checkpoint's `model.embed_tokens_extend.audio_embed.`: the encoder and, per
    projection mode, up-projection, GELU and down-projection into the decoder's width."""

    def __init__(self, audio_config, hidden_size: int) -> None:
        super().__init__()
        self.encoder = ConformerEncoder(ConformerConfig.from_hf(audio_config))
        width = self.encoder.cfg.width
        for mode in PROJECTIONS:
            setattr(self, f"up_proj_for_{_suffix(mode)}", EncoderLinear(width, hidden_size))
            setattr(self, f"down_proj_for_{_suffix(mode)}", EncoderLinear(hidden_size, hidden_size))

    def forward(self, items: list[dict]) -> list[torch.Tensor]:
        """Clips' processed inputs (audio_input_features [T, n_mels], projection) -> embeddings
        [ceil(T / time_reduction), hidden] each, every clip in one encoder forward."""
        device = self.encoder.embed.out.weight.device
        states = self.encoder([to_device(d["audio_input_features"], device) for d in items])
        out: list[torch.Tensor | None] = [None] * len(items)
        for mode in PROJECTIONS:
            chosen = [i for i, d in enumerate(items) if d["projection"] == mode]
            if not chosen:
                continue
            up = getattr(self, f"up_proj_for_{_suffix(mode)}")
            down = getattr(self, f"down_proj_for_{_suffix(mode)}")
            embeds = down(F.gelu(up(torch.cat([states[i] for i in chosen]))))
            for i, e in zip(chosen, embeds.split([len(states[i]) for i in chosen]), strict=True):
                out[i] = e
        return out


def _suffix(mode: str) -> str:
    return "speech" if mode == "speech" else "vision_speech"


class Phi4MMForCausalLM(Decoder):
    """Decoder + image embedding + audio embedding; adapters per modality."""

    def __init__(self, hf_config, max_positions: int, device: torch.device) -> None:
        rope = [dict(r) for r in layer_rope_from_hf(hf_config)]
        for r in rope:
            if r.get("rope_type") == "longrope":
                r["attention_factor"] = longrope_attention_factor(hf_config, r)
        # A window no sequence of ours reaches binds nothing (Phi-4-mini's is 262144).
        attention = tuple(LayerAttention(None, a.softcap) if a.sliding_window is not None
                          and a.sliding_window >= max_positions else a
                          for a in layer_attention_from_hf(hf_config))
        cfg = DecoderConfig.from_hf(hf_config, tie_word_embeddings=self.tied_head(hf_config)[0],
                                    layer_rope=tuple(rope), layer_attention=attention)
        super().__init__(cfg, max_positions, device)
        self.image_embed = ImageEmbedding(hf_config.vision_config, cfg.hidden_size)
        self.audio_embed = AudioEmbedding(hf_config.audio_config, cfg.hidden_size)

    @classmethod
    def from_hf_config(cls, hf_config, max_positions: int, device: torch.device):
        return cls(hf_config, max_positions, device)

    @classmethod
    def modality_adapters(cls) -> tuple[tuple[str, str, str], ...]:
        return (("vision", "image", "vision-lora"), ("speech", "audio", "speech-lora"))

    def encode(self, items: Sequence[EncoderItem]) -> list[torch.Tensor]:
        """Items ("image" | "audio", processed inputs) -> embeddings [n_i, hidden] each: every
        crop of the step in one tower forward, every clip in one encoder forward."""
        out: list[torch.Tensor | None] = [None] * len(items)
        for modality, embed in (("image", self.image_embed), ("audio", self.audio_embed)):
            chosen = [i for i, (m, _) in enumerate(items) if m == modality]
            if chosen:
                for i, e in zip(chosen, embed([items[i][1] for i in chosen]), strict=True):
                    out[i] = e
        unknown = [m for m, _ in items if m not in ("image", "audio")]
        if unknown:
            raise ValueError(f"Phi-4-multimodal encodes images and audio, not {unknown[0]}")
        return out

    def checkpoint_map(self) -> Callable:
        """transformers' layout: model.* (the decoder), lm_head.*,
        model.embed_tokens_extend.image_embed.*, model.embed_tokens_extend.audio_embed.*."""
        text = self.weight_map(prefix="model.", lm_head="lm_head.")
        extend = "model.embed_tokens_extend."
        image, audio = extend + "image_embed.", extend + "audio_embed."

        def mapping(name: str):
            if name.startswith(image):
                target = self.image_embed.checkpoint_name(name[len(image):])
                return None if target is None else ("image_embed." + target[0], target[1])
            if name.startswith(audio):
                return "audio_embed." + name[len(audio):], None
            return text(name)

        return mapping
