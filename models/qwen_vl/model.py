"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 (and Qwen3-VL-MoE and Qwen3.5-MoE, the same with
mixture-of-experts feed-forward blocks): a Qwen decoder with multimodal rotary positions (mRoPE)
and the vision towers of models/encoders/qwen_vl.py. Images and videos share the tower, so one
step's items of both modalities go through it in a single forward. Qwen3.5's decoder is hybrid
(three Gated DeltaNet layers to one attention layer, attention with an output gate and RoPE on a
quarter of each head; see models/layers/decoder_attention.py), its tower Qwen3-VL's without
DeepStack.

mRoPE: positions are [3, T] (temporal, row, column). The rotary table is indexed by each row and
every frequency takes its angle from one row: Qwen2/2.5-VL split the frequencies into
`mrope_section` bands (band i from row i % 3); Qwen3-VL and Qwen3.5 interleave them (t, h, w, t,
h, w..., each row for as many frequencies as its section says, the rest from t).

Qwen3-VL's DeepStack: the tower also returns K residuals per item (features of intermediate
blocks, merged), which the decoder adds to the item's positions after its first K layers; an
item's encoder output is then [1 + K, n, hidden] (see models/layers/decoder.py `residuals`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from models.encoders.qwen_vl import VisionConfig, VisionTower, build_vision_batch
from models.layers.decoder import Decoder, DecoderConfig, text_features
from models.layers.rotary import RotaryTable, mrope_bands, mrope_cos_sin
from models.loader import Shard
from models.qwen_vl.family import base_family

# Model types whose mRoPE interleaves its rows, and the `mrope_section` their reference classes
# assume when the config has none.
INTERLEAVED_SECTIONS = {"qwen3_vl": [24, 20, 20], "qwen3_5": [11, 11, 10]}


class QwenVLForConditionalGeneration(Decoder):
    """Decoder + vision tower. `encode` turns processed items into LLM embeddings."""

    position_rows = 3  # mRoPE: (temporal, row, column)

    def __init__(self, hf_config, max_positions: int, device: torch.device) -> None:
        text = hf_config.text_config
        cfg = DecoderConfig.from_hf(text, **text_features(text),
                                    tie_word_embeddings=self.tied_head(hf_config)[0])
        super().__init__(cfg, max_positions, device)
        self.visual = VisionTower(VisionConfig.from_hf(hf_config.vision_config))
        self.deepstack_layers = len(self.visual.cfg.deepstack_layers)
        family = base_family(hf_config.model_type)
        interleaved = family in INTERLEAVED_SECTIONS
        default = INTERLEAVED_SECTIONS.get(family, [16, 24, 24])
        section = list(self.cfg.rope.get("mrope_section", default))
        half = (self.cfg.rotary_dim or self.cfg.head_dim) // 2
        self.band = mrope_bands(section, half, interleaved).to(device)

    @classmethod
    def from_hf_config(cls, hf_config, max_positions: int, device: torch.device):
        return cls(hf_config, max_positions, device)

    def rotary_cos_sin(self, rotary: RotaryTable, positions: torch.Tensor, dtype: torch.dtype):
        """positions [3, T] -> cos, sin [T, 1, D/2], each band from its own position row."""
        return mrope_cos_sin(rotary, positions, self.band, dtype)

    def encode(self, items: list[tuple[str, dict]]) -> list[torch.Tensor]:
        """Items (modality, {"pixel_values", "grid_thw"}) -> embeddings [n_i, hidden] each
        ([1 + K, n_i, hidden] with K DeepStack layers).

        All items, images and videos alike, run through the tower in one forward.
        """
        device, dtype = self.embed_tokens.weight.device, self.embed_tokens.weight.dtype
        batch = build_vision_batch(
            [d["pixel_values"] for _, d in items], [tuple(d["grid_thw"]) for _, d in items],
            self.visual.cfg, device, dtype,
        )
        return list(self.visual(batch).split(batch.sizes, dim=-2))

    def checkpoint_map(self) -> Callable:
        """Both layouts: the Hub's (model.layers.*, visual.*) and transformers 5's
        (model.language_model.*, model.visual.*)."""
        new_lm = self.weight_map(prefix="model.language_model.")
        old_lm = self.weight_map(prefix="model.")
        inter = self.visual.cfg.mlp_hidden
        vision_fused = {"gate_proj": ("gate_up_proj", Shard(0, inter)),
                        "up_proj": ("gate_up_proj", Shard(inter, inter))}
        # Qwen3-VL's names for the same modules (blocks' MLP, mergers).
        renamed = {"linear_fc1": "fc1", "linear_fc2": "fc2"}
        merger_renamed = {"norm": "ln_q", "linear_fc1": "mlp.0", "linear_fc2": "mlp.2"}

        def mapping(name: str):
            for prefix in ("model.visual.", "visual."):
                if name.startswith(prefix):
                    parts = ("visual." + name[len(prefix):]).split(".")
                    if len(parts) >= 2 and parts[-2] in vision_fused:
                        target, shard = vision_fused[parts[-2]]
                        return ".".join(parts[:-2] + [target, parts[-1]]), shard
                    merger = parts[1] in ("merger", "deepstack_merger_list")
                    table = merger_renamed if merger else renamed
                    parts[-2] = table.get(parts[-2], parts[-2])
                    return ".".join(parts), None
            if name.startswith("model.language_model."):
                return new_lm(name)
            return old_lm(name)

        return mapping
