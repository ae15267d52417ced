"""LLaVA-1.5 and LLaVA-NeXT: a CLIP or SigLIP tower, a two-layer MLP projector, any supported
decoder (Llama, Mistral, Vicuna, Qwen2...).

An item is one image: LLaVA-1.5 sends one [1, 3, S, S] crop, LLaVA-NeXT ("anyres") the image
resized to S x S (the base) followed by the tiles of its best-fitting grid. Every tile of every
item of a step goes through the tower in one forward. LLaVA-NeXT then lays each image's tile
features out as one grid, cuts off the rows or columns that only hold padding (the processor
letterboxed the image into the grid's resolution), appends the learned `image_newline` to every
row, and puts the base image's features first. The processor counts tokens with the same
arithmetic (`unpad_bounds`), so counts and embeddings always agree.

A checkpoint with a Pixtral tower (Pixtral-12B) is served by models/mistral3/model.py's PixtralVLM
(see the registry's vision-tower variants).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from models.encoders.clip import (
    ClipVisionConfig,
    ClipVisionTower,
    select_features,
    vlm_checkpoint_map,
)
from models.interfaces import EncoderItem
from models.layers.decoder import Decoder, DecoderConfig, text_features
from models.layers.projectors import MLPProjector
from models.layers.transfer import to_device
from models.llava.preprocess import unpad_bounds


class LlavaForConditionalGeneration(Decoder):
    """Decoder + CLIP/SigLIP tower + MLP projector (+ image_newline for LLaVA-NeXT)."""

    def __init__(self, hf_config, max_positions: int, device: torch.device) -> None:
        text = hf_config.text_config
        cfg = DecoderConfig.from_hf(text, **text_features(text),
                                    tie_word_embeddings=self.tied_head(hf_config)[0])
        super().__init__(cfg, max_positions, device)
        self.vision_tower = ClipVisionTower(ClipVisionConfig.from_hf(hf_config.vision_config))
        layer = hf_config.vision_feature_layer
        self.feature_layers = self.vision_tower.resolve_layers(
            [layer] if isinstance(layer, int) else list(layer))
        self.strategy = hf_config.vision_feature_select_strategy
        select_features(torch.zeros(1, 2, 1), self.strategy)  # validates the strategy
        width = self.vision_tower.cfg.vit.width * len(self.feature_layers)
        self.multi_modal_projector = MLPProjector(
            width, self.cfg.hidden_size, hf_config.projector_hidden_act,
            bias=getattr(hf_config, "multimodal_projector_bias", True),
        )
        self.anyres = hf_config.model_type == "llava_next"
        if self.anyres:
            self.image_newline = nn.Parameter(torch.empty(self.cfg.hidden_size))
        self.side = self.vision_tower.cfg.image_size // self.vision_tower.cfg.patch_size

    @classmethod
    def from_hf_config(cls, hf_config, max_positions: int, device: torch.device):
        return cls(hf_config, max_positions, device)

    def encode(self, items: Sequence[EncoderItem]) -> list[torch.Tensor]:
        """Items ("image", {"pixel_values" [tiles, 3, S, S], "image_size", "grid"}) ->
        embeddings [n_i, hidden] each; all tiles of all items in one tower forward."""
        weight = self.embed_tokens.weight
        pixels = to_device(torch.cat([d["pixel_values"] for _, d in items]).to(weight.dtype),
                           weight.device)
        states = self.vision_tower(pixels, self.feature_layers)
        tiles = self.multi_modal_projector(select_features(states, self.strategy))
        out = []
        for (_, data), part in zip(
                items, tiles.split([d["pixel_values"].shape[0] for _, d in items]), strict=True):
            out.append(self._pack(part, data) if self.anyres else part.flatten(0, 1))
        return out

    def _pack(self, tiles: torch.Tensor, data: dict) -> torch.Tensor:
        """tiles [1 + rows * cols, side^2, H] -> base features, then the unpadded grid with a
        newline after every row: [n, H]."""
        base, grid = tiles[0], tiles[1:]
        hidden = base.shape[-1]
        if grid.shape[0] == 0:
            return torch.cat([base, self.image_newline[None].to(base.dtype)])
        rows, cols = data["grid"]
        side = self.side
        grid = grid.view(rows, cols, side, side, hidden).permute(4, 0, 2, 1, 3)
        grid = grid.reshape(hidden, rows * side, cols * side)  # [H, height, width]
        top, bottom, left, right = unpad_bounds(data["image_size"], rows * side, cols * side)
        grid = grid[:, top:bottom, left:right]
        newline = self.image_newline[:, None, None].to(grid.dtype)
        grid = torch.cat([grid, newline.expand(hidden, grid.shape[1], 1)], dim=-1)
        return torch.cat([base, grid.flatten(1, 2).transpose(0, 1)])

    def checkpoint_map(self) -> Callable:
        """See vlm_checkpoint_map."""
        return vlm_checkpoint_map(self, ("multi_modal_projector.", "image_newline"))

