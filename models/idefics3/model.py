"""Idefics3 and SmolVLM / SmolVLM2: a SigLIP tower (models/encoders/clip.py, its last hidden state
after `post_layernorm`), the pixel-shuffle connector (models/layers/pixel_shuffle.py) and a Llama
decoder (models/layers/decoder.py).

An encoder item is one image (its tiles row-major, then the global image) or one video (its
frames); every tile and frame is one tower input of tile x tile pixels, and becomes
(patches per side / scale_factor)^2 embeddings. All tiles and frames of a step go through the
tower in one forward; an item's embeddings are its tiles' in order, which is the order of the
`<image>` runs inside its span (models/idefics3/processor.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from models.encoders.clip import ClipVisionConfig, ClipVisionTower
from models.interfaces import EncoderItem
from models.layers.decoder import Decoder, DecoderConfig, text_features
from models.layers.pixel_shuffle import PixelShuffleProjector
from models.layers.transfer import to_device


def tokens_per_tile(hf_config) -> int:
    """Embeddings of one tile or frame: (patches per side / scale_factor)^2."""
    vision = hf_config.vision_config
    side = vision.image_size // vision.patch_size
    if side % hf_config.scale_factor:
        raise ValueError(f"{side} patches per side do not divide by scale_factor "
                         f"{hf_config.scale_factor}")
    return (side // hf_config.scale_factor) ** 2


class Idefics3ForConditionalGeneration(Decoder):
    """Llama decoder + SigLIP tower + pixel-shuffle connector."""

    def __init__(self, hf_config, max_positions: int, device: torch.device) -> None:
        text = hf_config.text_config
        cfg = DecoderConfig.from_hf(text, **text_features(text),
                                    tie_word_embeddings=self.tied_head(hf_config)[0])
        super().__init__(cfg, max_positions, device)
        vision = ClipVisionConfig.from_hf(hf_config.vision_config)
        self.vision_model = ClipVisionTower(vision, final_norm=True)
        self.connector = PixelShuffleProjector(vision.vit.width, hf_config.scale_factor,
                                               self.cfg.hidden_size)
        self.per_tile = tokens_per_tile(hf_config)

    @classmethod
    def from_hf_config(cls, hf_config, max_positions: int, device: torch.device):
        return cls(hf_config, max_positions, device)

    def encode(self, items: Sequence[EncoderItem]) -> list[torch.Tensor]:
        """Items ("image" | "video", {"pixel_values" [tiles, 3, S, S], ...}) -> embeddings
        [tiles * per_tile, hidden] each, every tile of the step in one tower forward."""
        weight = self.embed_tokens.weight
        pixels = to_device(torch.cat([d["pixel_values"] for _, d in items]).to(weight.dtype),
                           weight.device)
        tiles = self.connector(self.vision_model.last_hidden_state(pixels))
        counts = [d["pixel_values"].shape[0] for _, d in items]
        return [part.flatten(0, 1) for part in tiles.split(counts)]

    def checkpoint_map(self) -> Callable:
        """transformers' layout: model.text_model.*, lm_head.*, model.vision_model.*,
        model.connector.modality_projection.*."""
        text = self.weight_map(prefix="model.text_model.", lm_head="lm_head.")

        def mapping(name: str):
            if name.startswith("model.vision_model."):
                target = self.vision_model.checkpoint_name(name[len("model.vision_model."):])
                return None if target is None else ("vision_model." + target[0], target[1])
            if name.startswith("model.connector.modality_projection."):
                return "connector." + name[len("model.connector.modality_projection."):], None
            return text(name)

        return mapping
