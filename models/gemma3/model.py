"""Gemma 3 with vision (Gemma3ForConditionalGeneration): the Gemma decoder
(models/layers/decoder.py, `gemma_features`: interleaved local sliding-window and global layers with
their own rope bases) fed by a SigLIP tower and a pooling projector.

An encoder item is one image or one pan-and-scan crop, resized to the tower's size: its final
hidden states (after `post_layernorm`) are average-pooled from a patches x patches grid down to
`mm_tokens_per_image` (a square), RMS-normed with (1 + w) and projected by a matrix into the
decoder's width. The decoder attends to the tokens of one image both ways (their placeholder
spans are bidirectional, see models/layers/attention.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from models.encoders.clip import ClipVisionConfig, ClipVisionTower, vlm_checkpoint_map
from models.interfaces import EncoderItem
from models.layers.decoder import Decoder, DecoderConfig, gemma_features
from models.layers.norm import RMSNorm
from models.layers.transfer import to_device


class PoolingProjector(nn.Module):
    """[B, P, width] patch states on a side x side grid -> [B, tokens, hidden]: average pooling
    to a sqrt(tokens)-sided grid, a (1 + w) RMSNorm, a projection matrix."""

    def __init__(self, width: int, hidden: int, side: int, tokens: int, eps: float) -> None:
        super().__init__()
        per_side = math.isqrt(tokens)
        if per_side**2 != tokens or side % per_side:
            raise ValueError(
                f"mm_tokens_per_image={tokens} must be a square whose side divides the "
                f"tower's {side} patches per side"
            )
        self.side, self.kernel = side, side // per_side
        self.mm_input_projection_weight = nn.Parameter(torch.empty(width, hidden))
        self.mm_soft_emb_norm = RMSNorm(width, eps, unit_offset=True)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        b, _, width = states.shape
        grid = states.transpose(1, 2).reshape(b, width, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        normed = self.mm_soft_emb_norm(pooled)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(states)


class Gemma3ForConditionalGeneration(Decoder):
    """Gemma 3 decoder + SigLIP tower + pooling projector."""

    def __init__(self, hf_config, max_positions: int, device: torch.device) -> None:
        text = hf_config.text_config
        cfg = DecoderConfig.from_hf(text, **gemma_features(text),
                                    tie_word_embeddings=self.tied_head(hf_config)[0])
        super().__init__(cfg, max_positions, device)
        vision = ClipVisionConfig.from_hf(hf_config.vision_config)
        self.vision_tower = ClipVisionTower(vision, final_norm=True)
        self.multi_modal_projector = PoolingProjector(
            vision.vit.width, self.cfg.hidden_size, vision.image_size // vision.patch_size,
            hf_config.mm_tokens_per_image, hf_config.vision_config.layer_norm_eps,
        )

    @classmethod
    def from_hf_config(cls, hf_config, max_positions: int, device: torch.device):
        return cls(hf_config, max_positions, device)

    def encode(self, items: Sequence[EncoderItem]) -> list[torch.Tensor]:
        """Items ("image", {"pixel_values" [3, S, S]}) -> [mm_tokens_per_image, hidden] each;
        every image and crop of the step in one tower forward."""
        weight = self.embed_tokens.weight
        pixels = torch.stack([d["pixel_values"] for _, d in items]).to(weight.dtype)
        states = self.vision_tower.last_hidden_state(to_device(pixels, weight.device))
        return list(self.multi_modal_projector(states).unbind(0))

    def checkpoint_map(self) -> Callable:
        """See models.encoders.clip.vlm_checkpoint_map."""
        return vlm_checkpoint_map(self, ("multi_modal_projector.",))
