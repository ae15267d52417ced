"""Mistral Small 3.1 (Mistral3ForConditionalGeneration) and LLaVA with a Pixtral tower
(Pixtral-12B): a Pixtral vision encoder (models/encoders/pixtral.py), a projector, a Mistral or
Llama decoder (models/layers/decoder.py).

An encoder item is one image at its own size; every image of a step goes through the tower in
one forward. Mistral 3's projector RMS-norms the tower's features, concatenates each m x m
block of patches (channel-major, as torch's `unfold` lays them out) and projects the block back
to the tower's width (`patch_merger.merging_layer`), then applies linear-GELU-linear; LLaVA's
is the linear-GELU-linear alone. The embeddings of an image are its merged blocks row by row:
the processor's `[IMG]` positions in the same order (its row breaks keep their text embeddings).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from models.encoders.clip import vlm_checkpoint_map
from models.encoders.pixtral import PixtralVisionConfig, PixtralVisionTower, build_pixtral_batch
from models.interfaces import EncoderItem
from models.kernels.linear import EncoderLinear
from models.layers.decoder import Decoder, DecoderConfig, text_features
from models.layers.norm import RMSNorm
from models.layers.projectors import MLPProjector


class MergingProjector(MLPProjector):
    """[N, width] merge-block-major patch features -> [N / m^2, out_dim]: RMSNorm, each block's
    m^2 patches concatenated channel-major and linearly mapped back to `width`, then
    linear_2(act(linear_1(x)))."""

    def __init__(self, width: int, out_dim: int, merge: int, act: str, bias: bool,
                 eps: float) -> None:
        super().__init__(width, out_dim, act, bias)
        self.merge = merge
        self.norm = RMSNorm(width, eps)
        self.patch_merger = nn.Module()
        self.patch_merger.merging_layer = EncoderLinear(width * merge**2, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width, unit = x.shape[-1], self.merge**2
        x = self.norm(x).view(-1, unit, width).transpose(1, 2).reshape(-1, width * unit)
        return super().forward(self.patch_merger.merging_layer(x))


class PixtralVLM(Decoder):
    """Decoder + Pixtral tower + projector (merging when the config has `spatial_merge_size`,
    Mistral 3; LLaVA's MLP otherwise)."""

    def __init__(self, hf_config, max_positions: int, device: torch.device) -> None:
        text = hf_config.text_config
        cfg = DecoderConfig.from_hf(text, **text_features(text),
                                    tie_word_embeddings=self.tied_head(hf_config)[0])
        super().__init__(cfg, max_positions, device)
        self.vision_tower = PixtralVisionTower(PixtralVisionConfig.from_hf(hf_config.vision_config))
        layer = hf_config.vision_feature_layer
        self.feature_layers = self.vision_tower.resolve_layers(
            [layer] if isinstance(layer, int) else list(layer))
        strategy = getattr(hf_config, "vision_feature_select_strategy", "full")
        if strategy != "full":
            raise NotImplementedError(
                f"vision_feature_select_strategy {strategy!r} with a Pixtral tower (it has no "
                "class token to drop; 'full' only)")
        width = self.vision_tower.cfg.vit.width * len(self.feature_layers)
        act, bias = hf_config.projector_hidden_act, hf_config.multimodal_projector_bias
        merge = getattr(hf_config, "spatial_merge_size", None)
        self.merge = merge or 1
        if merge is None:
            self.multi_modal_projector = MLPProjector(width, self.cfg.hidden_size, act, bias)
        elif len(self.feature_layers) > 1:
            raise NotImplementedError(
                "several vision_feature_layer entries with a merging projector (its norm and "
                "merger take the tower's width, as in transformers)")
        else:
            self.multi_modal_projector = MergingProjector(
                width, self.cfg.hidden_size, self.merge, act, bias, text.rms_norm_eps)

    @classmethod
    def from_hf_config(cls, hf_config, max_positions: int, device: torch.device):
        return cls(hf_config, max_positions, device)

    def encode(self, items: Sequence[EncoderItem]) -> list[torch.Tensor]:
        """Items ("image", {"pixel_values" [3, H, W], ...}) -> embeddings
        [H * W / (patch * merge)^2, hidden] each; all images in one tower forward."""
        weight = self.embed_tokens.weight
        batch = build_pixtral_batch([d["pixel_values"] for _, d in items],
                                    self.vision_tower.cfg.patch_size, self.merge, weight.device,
                                    weight.dtype)
        states = self.vision_tower(batch, self.feature_layers)
        merged = self.multi_modal_projector(states)
        return list(merged.split([n // self.merge**2 for n in batch.sizes]))

    def checkpoint_map(self) -> Callable:
        """See vlm_checkpoint_map."""
        return vlm_checkpoint_map(self, ("multi_modal_projector.",))
