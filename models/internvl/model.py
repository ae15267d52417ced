"""InternVL 2.5 / 3 / 3.5 (transformers' InternVLForConditionalGeneration): the InternViT tower
(models/encoders/internvit.py), pixel shuffle, a LayerNorm + two-layer MLP projector, and the
decoder the text config names (Qwen2, Qwen3, Qwen3-MoE, Llama; models/layers/decoder.py).

An encoder item is one tile of an image (its grid's tiles row-major, then the thumbnail) or one
frame of a video; each is one tower input of S x S pixels and becomes (S / patch / s)^2
embeddings, s = 1 / `downsample_ratio`: the class token is dropped, and each s x s block of
patches is folded into one token s^2 times as wide (the same fold as Idefics3's connector,
models/layers/pixel_shuffle.py). All tiles and frames of a step go through the tower in one
forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from models.encoders.clip import vlm_checkpoint_map
from models.encoders.internvit import InternViT, InternViTConfig
from models.interfaces import EncoderItem
from models.layers.decoder import Decoder, DecoderConfig, text_features
from models.layers.pixel_shuffle import pixel_shuffle
from models.layers.projectors import MLPProjector
from models.layers.transfer import to_device


def shuffle_scale(hf_config) -> int:
    """s = 1 / downsample_ratio, which must be a whole number (transformers sizes the projector
    with int(1 / downsample_ratio) and folds s x s patches)."""
    ratio = hf_config.downsample_ratio
    scale = round(1 / ratio) if ratio > 0 else 0
    if scale < 1 or abs(scale * ratio - 1) > 1e-9:
        raise NotImplementedError(f"config.json downsample_ratio={ratio}: only ratios 1 / s for "
                                  "a whole s are supported")
    return scale


def tokens_per_tile(hf_config) -> int:
    """Embeddings of one tile or frame: (patches per side / s)^2."""
    side = InternViTConfig.from_hf(hf_config.vision_config).side
    scale = shuffle_scale(hf_config)
    if side % scale:
        raise ValueError(f"{side} patches per side do not divide by 1 / downsample_ratio "
                         f"= {scale}")
    return (side // scale) ** 2


class InternVLProjector(MLPProjector):
    """linear_2(act(linear_1(layer_norm(x)))) (`multi_modal_projector`)."""

    def __init__(self, in_dim: int, out_dim: int, act: str) -> None:
        super().__init__(in_dim, out_dim, act)
        self.layer_norm = nn.LayerNorm(in_dim)  # the reference keeps LayerNorm's own eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.layer_norm(x))


class InternVLForConditionalGeneration(Decoder):
    """Decoder + InternViT + pixel shuffle + projector."""

    def __init__(self, hf_config, max_positions: int, device: torch.device) -> None:
        text = hf_config.text_config
        cfg = DecoderConfig.from_hf(text, **text_features(text),
                                    tie_word_embeddings=self.tied_head(hf_config)[0])
        super().__init__(cfg, max_positions, device)
        vision = InternViTConfig.from_hf(hf_config.vision_config)
        self.vision_tower = InternViT(vision)
        layer = hf_config.vision_feature_layer
        if not isinstance(layer, int):  # the reference indexes one tuple with it
            raise NotImplementedError(f"config.json vision_feature_layer={layer!r}: only one "
                                      "layer is supported, as InternVLModel reads one")
        self.blocks = self.vision_tower.resolve_layer(layer)
        strategy = hf_config.vision_feature_select_strategy
        if strategy != "default":  # "full" keeps the class token: no square grid to shuffle
            raise NotImplementedError(
                f"config.json vision_feature_select_strategy={strategy!r}: only 'default' (the "
                "class token dropped) is supported; transformers cannot shuffle the others")
        self.scale = shuffle_scale(hf_config)
        self.per_tile = tokens_per_tile(hf_config)
        self.multi_modal_projector = InternVLProjector(
            vision.width * self.scale**2, self.cfg.hidden_size, hf_config.projector_hidden_act)

    @classmethod
    def from_hf_config(cls, hf_config, max_positions: int, device: torch.device):
        return cls(hf_config, max_positions, device)

    def encode(self, items: Sequence[EncoderItem]) -> list[torch.Tensor]:
        """Items ("image" | "video", {"pixel_values" [n, 3, S, S]}, one tile or frame each) ->
        embeddings [n * per_tile, hidden] each, every tile of the step in one tower forward."""
        weight = self.embed_tokens.weight
        pixels = to_device(torch.cat([d["pixel_values"] for _, d in items]).to(weight.dtype),
                           weight.device)
        states = self.vision_tower(pixels, self.blocks)[:, 1:]  # [N, side^2, width]
        tiles = self.multi_modal_projector(pixel_shuffle(states, self.scale))
        counts = [d["pixel_values"].shape[0] for _, d in items]
        return [part.flatten(0, 1) for part in tiles.split(counts)]

    def checkpoint_map(self) -> Callable:
        """Both layouts: the Hub's (language_model.model.*, language_model.lm_head.*,
        vision_tower.*, multi_modal_projector.*; what transformers still writes) and the one
        transformers 5 loads into (model.language_model.*, lm_head.*, model.vision_tower.*,
        model.multi_modal_projector.*)."""
        return vlm_checkpoint_map(self, ("multi_modal_projector.",))
