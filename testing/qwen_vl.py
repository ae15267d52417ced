"""transformers' inputs for a Qwen-VL family's prompt as this engine processed it (the
reference side of the Qwen2-VL / Qwen2.5-VL tests and of bench.media_turn's video row)."""

from __future__ import annotations

import torch


def qwen_vl_hf_inputs(hf, proc) -> dict:
    """transformers' generate() inputs for a Qwen-VL family's processed prompt, with the
    `mm_token_type_ids` its mRoPE needs (1 image, 2 video); one video's temporal groups go
    back into one tensor."""
    ids = torch.tensor([proc.token_ids])
    cfg = hf.config
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
              "mm_token_type_ids": (ids == cfg.image_token_id).int()
              + 2 * (ids == cfg.video_token_id).int()}
    images = [f.data for f in proc.mm_features if f.modality == "image"]
    if images:
        kwargs["pixel_values"] = torch.cat([d["pixel_values"] for d in images])
        kwargs["image_grid_thw"] = torch.tensor([d["grid_thw"] for d in images])
    groups = [f.data for f in proc.mm_features if f.modality == "video"]
    if groups:
        kwargs["pixel_values_videos"] = torch.cat([d["pixel_values"] for d in groups])
        kwargs["video_grid_thw"] = torch.tensor([(len(groups), *groups[0]["grid_thw"][1:])])
    return kwargs
