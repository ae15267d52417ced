"""transformers-side references several test modules share: Qwen2-VL's PIL image processor and
the video patches built from it frame by frame, and a processor class's attributes read from
its source."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from models.processing.qwen_vision import VisionPreprocessConfig

CFG = VisionPreprocessConfig()


def hf_processor(min_pixels: int = CFG.min_pixels, max_pixels: int = CFG.max_pixels):
    return Qwen2VLImageProcessorPil(
        patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=min_pixels,
        max_pixels=max_pixels, image_mean=list(CFG.image_mean), image_std=list(CFG.image_std),
    )


def hf_video_reference(frames: np.ndarray, min_pixels: int, max_pixels: int) -> torch.Tensor:
    """Patch rows of a video built from HF's PIL image processor, one frame at a time.

    transformers' own video processor needs torchvision (absent here) and resizes with it, so
    the reference is its image path, which is what our video path promises to reproduce: every
    frame through HF's resize (PIL bicubic on uint8), rescale, normalize and patch ordering as a
    still image (rows (channel, temporal slot, y, x) holding that frame in both slots), then
    consecutive frames paired into the temporal slots, an odd tail paired with itself (HF's
    video processor pads by repeating the last frame).
    """
    processor = hf_processor(min_pixels, max_pixels)
    per_frame = [
        processor(Image.fromarray(f), return_tensors="pt")["pixel_values"] for f in frames
    ]
    per_frame += per_frame[-1:] * (len(per_frame) % 2)
    stills = torch.stack(per_frame).unflatten(-1, (3, 2, 14 * 14))  # [N, rows, C, tp, p*p]
    pairs = torch.stack([stills[0::2, :, :, 0], stills[1::2, :, :, 0]], dim=3)
    return pairs.flatten(2).flatten(0, 1)  # [N/2 * rows, C*tp*p*p]


def class_attributes(module: str, cls: str) -> dict:
    """A class's attributes read from its source (its module needs torchvision to import)."""
    import transformers.image_utils as iu

    source = Path(importlib.util.find_spec(module).origin).read_text()
    names = {"PILImageResampling": iu.PILImageResampling, "OPENAI_CLIP_MEAN": iu.OPENAI_CLIP_MEAN,
             "OPENAI_CLIP_STD": iu.OPENAI_CLIP_STD,
             "IMAGENET_STANDARD_MEAN": iu.IMAGENET_STANDARD_MEAN,
             "IMAGENET_STANDARD_STD": iu.IMAGENET_STANDARD_STD}
    body = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls)
    out = {}
    for node in body.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = eval(compile(ast.Expression(node.value), "", "eval"),
                                               dict(names))
            except NameError:
                continue
    return out


def same_value(ours, theirs) -> bool:
    """Equal once tuples are lists and enum members their values."""
    norm = lambda v: list(v) if isinstance(v, tuple) else int(v) if hasattr(v, "value") else v  # noqa: E731
    return norm(ours) == norm(theirs)
