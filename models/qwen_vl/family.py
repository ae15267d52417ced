"""Which dense Qwen-VL family a checkpoint's model type belongs to: the mixture-of-experts
variants (Qwen3-VL-MoE, Qwen3.5-MoE) have their dense family's vision tower, processor and
positions, with sparse feed-forward blocks in the decoder (models/layers/moe.py)."""

from __future__ import annotations


def base_family(model_type: str) -> str:
    """"qwen3_vl_moe" -> "qwen3_vl", "qwen3_5_moe" -> "qwen3_5"; others unchanged."""
    return model_type.removesuffix("_moe")
