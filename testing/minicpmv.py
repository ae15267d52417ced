"""Tiny random-weight MiniCPM-V 4.6 checkpoints (MiniCPMV4_6ForConditionalGeneration: a SigLIP
tower on 4-px patches with the window-attention merger after its second block, the downsampling
MLP, and Qwen3.5's hybrid decoder), a tokenizer with the family's structure tokens named as
transformers' processor reads them (`image_token`, `slice_start_token`, ...), a ChatML template
writing `<|image_pad|>` / `<|video_pad|>` per item, and the processor saved by transformers' own
`MiniCPMV4_6Processor.save_pretrained` (`hf_processor`: its video processor class is built
directly, only its frame resizing needs torchvision; the processor's check of its components'
classes looks the video processor up in a mapping that lacks it without torchvision, so that
check alone is skipped).

Slices are `scale` pixels square (64 by default: 16 x 16 patches, 16 embeddings in the "16x"
mode); images above that area are cut into at most `max_slice_nums` slices."""

from __future__ import annotations

from pathlib import Path

import torch

from testing.qwen3_5 import LAYER_TYPES, text_config
from testing.tiny import QWEN_SPECIAL, chatml_template, randomize, save_checkpoint, train_tokenizer

# The structure tokens, by the tokenizer attribute transformers' processor reads each from.
STRUCTURE = {
    "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
    "image_start_token": "<image>", "image_end_token": "</image>",
    "slice_start_token": "<slice>", "slice_end_token": "</slice>",
    "image_id_start_token": "<image_id>", "image_id_end_token": "</image_id>",
}
MINICPMV_SPECIAL = list(dict.fromkeys([*QWEN_SPECIAL, *STRUCTURE.values()]))
MINICPMV_CHAT_TEMPLATE = chatml_template("<|image_pad|>", "<|video_pad|>", "")
PATCH = 4
SCALE = 64


def minicpmv_tokenizer(vocab_size: int = 600, kind: str = "bytes"):
    """A tokenizer (`kind` of testing.tiny.train_tokenizer) with ChatML, the structure tokens
    and their names."""
    tok = train_tokenizer(MINICPMV_SPECIAL, vocab_size, MINICPMV_CHAT_TEMPLATE, "<|im_end|>",
                          kind)
    tok._set_model_specific_special_tokens(special_tokens=dict(STRUCTURE))
    return tok


def build_minicpmv_model(
    path: Path,
    *,
    hidden_size: int = 64,
    layer_types: tuple[str, ...] = LAYER_TYPES,
    vision_width: int = 32,
    vision_depth: int = 3,
    insert_layer_id: int = 1,
    scale: int = SCALE,
    patch: int = PATCH,
    max_slice_nums: int = 4,
    max_num_frames: int = 8,
    downsample_mode: str = "16x",
    use_image_id: bool = True,
    seed: int = 0,
    std: float = 0.25,
    tie_word_embeddings: bool | None = None,
    text_overrides: dict | None = None,
    vision_overrides: dict | None = None,
    tokenizer_kind: str = "bytes",
) -> Path:
    """A tiny MiniCPMV4_6ForConditionalGeneration at `path`, with its processor; the
    overrides go to the text and vision configs as they are (the benchmark's real widths)."""
    import transformers
    from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import (
        MiniCPMV4_6VideoProcessor,
    )

    tokenizer = minicpmv_tokenizer(kind=tokenizer_kind)
    special = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    vision = {**dict(hidden_size=vision_width, intermediate_size=2 * vision_width,
                     num_hidden_layers=vision_depth, num_attention_heads=4, image_size=scale,
                     patch_size=patch), **(vision_overrides or {})}
    config = transformers.MiniCPMV4_6Config(
        text_config={"model_type": "qwen3_5_text",
                     **text_config(tokenizer, special, hidden_size, layer_types),
                     **(text_overrides or {})},
        vision_config=vision, insert_layer_id=insert_layer_id, downsample_mode=downsample_mode,
        image_token_id=tokenizer.convert_tokens_to_ids(STRUCTURE["image_token"]),
        video_token_id=tokenizer.convert_tokens_to_ids(STRUCTURE["video_token"]),
    )
    if tie_word_embeddings is not None:  # the flag transformers ties the head by
        config.tie_word_embeddings = tie_word_embeddings
    torch.manual_seed(seed)
    model = transformers.MiniCPMV4_6ForConditionalGeneration(config)
    randomize(model, std=std, seed=seed)
    path = save_checkpoint(model, tokenizer, Path(path), [tokenizer.eos_token_id])
    settings = dict(scale_resolution=scale, patch_size=patch, max_slice_nums=max_slice_nums,
                    downsample_mode=downsample_mode, use_image_id=use_image_id)
    hf_processor(
        transformers.MiniCPMV4_6ImageProcessorPil(**settings),
        MiniCPMV4_6VideoProcessor(**settings, max_num_frames=max_num_frames), tokenizer,
    ).save_pretrained(path)
    return path


def hf_processor(image_processor, video_processor, tokenizer):
    """transformers' MiniCPMV4_6Processor over these components (see the module docstring)."""
    from unittest import mock

    import transformers
    from transformers.processing_utils import ProcessorMixin

    with mock.patch.object(ProcessorMixin, "check_argument_for_proper_class", lambda *a: None):
        return transformers.MiniCPMV4_6Processor(
            image_processor=image_processor, video_processor=video_processor,
            tokenizer=tokenizer, chat_template=tokenizer.chat_template)


def load_hf_processor(path: Path):
    """transformers' MiniCPMV4_6Processor as a user's from_pretrained would build it from
    `path` (the image processor's PIL class, the video processor's own class)."""
    import transformers
    from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import (
        MiniCPMV4_6VideoProcessor,
    )

    return hf_processor(transformers.MiniCPMV4_6ImageProcessorPil.from_pretrained(path),
                        MiniCPMV4_6VideoProcessor.from_pretrained(path),
                        transformers.AutoTokenizer.from_pretrained(path))
