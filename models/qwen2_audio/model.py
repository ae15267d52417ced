"""Qwen2-Audio: the Qwen2 decoder fed by the Whisper-style audio encoder
(models/encoders/whisper.py) through a linear projector into the LLM's width."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from models.encoders.whisper import (
    AudioEncoder,
    AudioEncoderConfig,
    build_audio_batch,
    whisper_block_name,
)
from models.kernels.linear import EncoderLinear
from models.layers.decoder import QWEN2_FEATURES, Decoder, DecoderConfig


class QwenAudioForConditionalGeneration(Decoder):
    """Decoder + audio encoder + projector. `encode` turns processed clips into embeddings."""

    def __init__(self, hf_config, max_positions: int, device: torch.device) -> None:
        super().__init__(DecoderConfig.from_hf(hf_config.text_config, **QWEN2_FEATURES,
                               tie_word_embeddings=self.tied_head(hf_config)[0]),
                         max_positions, device)
        self.audio_tower = AudioEncoder(AudioEncoderConfig.from_hf(hf_config.audio_config))
        self.multi_modal_projector = nn.Module()
        self.multi_modal_projector.linear = EncoderLinear(self.audio_tower.cfg.width,
                                                      self.cfg.hidden_size)

    @classmethod
    def tied_head(cls, hf_config) -> tuple[bool, str]:
        """transformers' Qwen2AudioForConditionalGeneration declares no tied weights: its head
        is never tied, whatever the flags say."""
        return False, "Qwen2AudioForConditionalGeneration never ties its head (transformers)"

    @classmethod
    def from_hf_config(cls, hf_config, max_positions: int, device: torch.device):
        return cls(hf_config, max_positions, device)

    def encode(self, items: list[tuple[str, dict]]) -> list[torch.Tensor]:
        """Items ("audio", {"input_features", "num_frames"}) -> embeddings [n_i, hidden] each,
        every clip in one encoder forward."""
        weight = self.embed_tokens.weight
        batch = build_audio_batch(
            [d["input_features"] for _, d in items], [d["num_frames"] for _, d in items],
            weight.device, weight.dtype,
        )
        states = self.audio_tower(batch)  # [sum(sizes), width]
        return list(self.multi_modal_projector.linear(states).split(batch.sizes))

    def checkpoint_map(self) -> Callable:
        """Both layouts: the Hub's (audio_tower.*, multi_modal_projector.*,
        language_model.model.*, language_model.lm_head.*) and transformers 5's (model.audio_tower.*,
        model.multi_modal_projector.*, model.language_model.*, lm_head.*)."""
        hub_lm = self.weight_map(prefix="language_model.model.", lm_head="language_model.lm_head.")
        new_lm = self.weight_map(prefix="model.language_model.", lm_head="lm_head.")

        def mapping(name: str):
            for module in ("audio_tower.", "multi_modal_projector."):
                for prefix in ("model." + module, module):
                    if name.startswith(prefix):
                        return module + whisper_block_name(name[len(prefix):]), None
            return hub_lm(name) if name.startswith("language_model.") else new_lm(name)

        return mapping
