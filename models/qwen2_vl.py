"""Qwen2-VL and Qwen2.5-VL: the Qwen2 decoder with multimodal rotary positions (mRoPE) and the
vision tower of models/qwen_vl_vision.py. Images and videos share the tower, so one step's items
of both modalities go through it in a single forward.

mRoPE: positions are [3, T] (temporal, row, column). The rotary table is indexed by each row and
the head dimension is split into `mrope_section` bands, band i taking its angles from row i % 3.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from models.decoder import QWEN2_FEATURES, Decoder, DecoderConfig
from models.layers import RotaryTable
from models.loader import Shard
from models.qwen_vl_vision import VisionConfig, VisionTower, build_vision_batch


class QwenVLForConditionalGeneration(Decoder):
    """Decoder + vision tower. `encode` turns processed items into LLM embeddings."""

    position_rows = 3  # mRoPE: (temporal, row, column)

    def __init__(self, hf_config, max_positions: int, device: torch.device) -> None:
        text = hf_config.text_config
        tie = bool(getattr(hf_config, "tie_word_embeddings", False))
        cfg = DecoderConfig.from_hf(text, **QWEN2_FEATURES, tie_word_embeddings=tie)
        super().__init__(cfg, max_positions, device)
        self.qwen25 = hf_config.model_type == "qwen2_5_vl"
        self.visual = VisionTower(VisionConfig.from_hf(hf_config.vision_config, self.qwen25))
        half = self.cfg.head_dim // 2
        section = list(self.cfg.rope.get("mrope_section", [16, 24, 24]))
        if sum(section) != half:
            raise ValueError(f"mrope_section {section} must sum to head_dim / 2 = {half}")
        # For each frequency index, which position row (t, h, w) drives it.
        bands = torch.cat([torch.full((n,), i % 3, device="cpu") for i, n in enumerate(section)])
        self.band = bands.to(device)  # [D/2] int64

    @classmethod
    def from_hf_config(cls, hf_config, max_positions: int, device: torch.device):
        return cls(hf_config, max_positions, device)

    def rotary_cos_sin(self, rotary: RotaryTable, positions: torch.Tensor, dtype: torch.dtype):
        """positions [3, T] -> cos, sin [T, 1, D/2], each band from its own position row."""
        cos, sin = rotary.cos[positions], rotary.sin[positions]  # [3, T, D/2]
        band = self.band[None, :].expand(positions.shape[1], -1)  # [T, D/2]
        cos = cos.gather(0, band[None]).squeeze(0)
        sin = sin.gather(0, band[None]).squeeze(0)
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]

    def encode(self, items: list[tuple[str, dict]]) -> list[torch.Tensor]:
        """Items (modality, {"pixel_values", "grid_thw"}) -> embeddings [n_i, hidden] each.

        All items, images and videos alike, run through the tower in one forward.
        """
        device, dtype = self.embed_tokens.weight.device, self.embed_tokens.weight.dtype
        batch = build_vision_batch(
            [d["pixel_values"] for _, d in items], [tuple(d["grid_thw"]) for _, d in items],
            self.visual.cfg, device, dtype,
        )
        return list(self.visual(batch).split(batch.sizes))

    def checkpoint_map(self) -> Callable:
        """Both layouts: the Hub's (model.layers.*, visual.*) and transformers 5's
        (model.language_model.*, model.visual.*)."""
        new_lm = self.weight_map(prefix="model.language_model.")
        old_lm = self.weight_map(prefix="model.")
        inter = self.visual.cfg.mlp_hidden
        vision_fused = {"gate_proj": ("gate_up_proj", Shard(0, inter)),
                        "up_proj": ("gate_up_proj", Shard(inter, inter))}

        def mapping(name: str):
            for prefix in ("model.visual.", "visual."):
                if name.startswith(prefix):
                    parts = ("visual." + name[len(prefix):]).split(".")
                    if len(parts) >= 2 and parts[-2] in vision_fused:
                        target, shard = vision_fused[parts[-2]]
                        return ".".join(parts[:-2] + [target, parts[-1]]), shard
                    return ".".join(parts), None
            if name.startswith("model.language_model."):
                return new_lm(name)
            return old_lm(name)

        return mapping
