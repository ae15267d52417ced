"""MiniCPM-V 4.6: the vision tower of models/encoders/minicpmv.py and the decoder its text config
names (Qwen3.5's hybrid one on the Hub), with 1-D positions.

An encoder item is one picture: an image, or one frame of a video, with its overview and its
slices (models/minicpmv/preprocess.py). All slices of a step's pictures, images and frames
alike, go through the tower in one forward; a picture's embeddings are its overview's, then its
slices' row by row, the order of the pad runs inside its span (models/minicpmv/processor.py).

Settings of config.json, as transformers 5.24's class reads them: the vision config's widths,
patch_size, image_size (the position table's side in patches), layer_norm_eps, hidden_act (the
blocks' MLP; the window merger's MLP is tanh GELU whatever it says) and window_kernel_size (2 x 2
only: the merger MLPs are built four times wide); insert_layer_id, merge_kernel_size (2 x 2
only), merger_times and downsample_mode at the top level (the processor's must agree); the text
config through models/layers/decoder.py; tie_word_embeddings at the top level. The top-level
image_size and drop_vision_last_layer are read by nothing in transformers' class, nor here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from models.encoders.minicpmv import (
    MiniCPMVVisionConfig,
    MiniCPMVVisionTower,
    SliceBatch,
    merger_checkpoint_name,
    tower_checkpoint_name,
)
from models.interfaces import EncoderItem
from models.layers.decoder import Decoder, DecoderConfig, text_features
from models.layers.transfer import to_device


class MiniCPMVForConditionalGeneration(Decoder):
    """Decoder + MiniCPM-V tower (window merger, downsampling MLP)."""

    def __init__(self, hf_config, max_positions: int, device: torch.device) -> None:
        text = hf_config.text_config
        cfg = DecoderConfig.from_hf(text, **text_features(text),
                                    tie_word_embeddings=self.tied_head(hf_config)[0])
        super().__init__(cfg, max_positions, device)
        self.vision_tower = MiniCPMVVisionTower(MiniCPMVVisionConfig.from_hf(hf_config))

    @classmethod
    def from_hf_config(cls, hf_config, max_positions: int, device: torch.device):
        return cls(hf_config, max_positions, device)

    def encode(self, items: Sequence[EncoderItem]) -> list[torch.Tensor]:
        """Pictures ("image" | "video", {"pixel_values" [3, patch, L * patch], "patch_grids"
        ((h, w) per slice), "merged" (the "16x" mode)}) -> embeddings [n_i, hidden] each."""
        weight = self.embed_tokens.weight
        pixels = torch.cat([d["pixel_values"] for _, d in items], dim=-1)
        batch = SliceBatch(
            grids=tuple(g for _, d in items for g in d["patch_grids"]),
            merged=tuple(d["merged"] for _, d in items for _ in d["patch_grids"]))
        out = self.vision_tower(to_device(pixels, weight.device), batch).to(weight.dtype)
        per_slice = iter(batch.embeddings(self.vision_tower.cfg.merger_times))
        counts = [sum(next(per_slice) for _ in d["patch_grids"]) for _, d in items]
        return list(out.split(counts))

    def checkpoint_map(self) -> Callable:
        """transformers 5's layout (the only one transformers reads for this class):
        model.language_model.*, lm_head.*, model.vision_tower.*, model.merger.*."""
        text = self.weight_map(prefix="model.language_model.", lm_head="lm_head.")
        width = self.vision_tower.cfg.vit.width

        def mapping(name: str):
            if name.startswith("model.vision_tower."):
                target = tower_checkpoint_name(name[len("model.vision_tower."):], width)
                return None if target is None else ("vision_tower." + target[0], target[1])
            if name.startswith("model.merger."):
                return "vision_tower." + merger_checkpoint_name(name[len("model.merger."):]), None
            return text(name)

        return mapping
