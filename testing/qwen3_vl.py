"""Tiny random-weight Qwen3-VL checkpoints (Qwen3VLForConditionalGeneration: Qwen3 decoder with
interleaved mRoPE, 16-px patch tower with learned positions and DeepStack mergers; with
`experts`, Qwen3VLMoeForConditionalGeneration, the same with mixture-of-experts layers) and
Qwen3-VL's image and video processor settings in transformers 5's layout."""

from __future__ import annotations

from pathlib import Path

import torch

from testing.layouts import save_processor
from testing.tiny import QWEN_SPECIAL, qwen_tokenizer, randomize, save_checkpoint


def build_qwen3_vl_model(
    path: Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 3,
    vision_width: int = 32,
    vision_depth: int = 3,
    deepstack: tuple[int, ...] = (0, 1),
    max_image_tokens: int = 64,
    seed: int = 0,
    std: float = 0.25,
    tie_word_embeddings: bool | None = None,
    experts: dict | None = None,
    **save_kwargs,
) -> Path:
    """A tiny Qwen3VLForConditionalGeneration at `path` whose tower feeds DeepStack residuals
    from blocks `deepstack` into the first len(deepstack) decoder layers. `experts` (text
    config fields such as num_experts, num_experts_per_tok, moe_intermediate_size,
    mlp_only_layers): a Qwen3VLMoeForConditionalGeneration instead; `save_kwargs` go to
    save_pretrained (`save_original_format=False`: transformers 5's in-memory layout)."""
    import transformers

    tokenizer = qwen_tokenizer()
    special = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    heads = 4
    text = dict(
        hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=2, head_dim=hidden_size // heads,
        vocab_size=len(tokenizer), max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5, "mrope_section": [2, 3, 3],
                         "mrope_interleaved": True},
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        pad_token_id=special["<|endoftext|>"],
    )
    vision = dict(depth=vision_depth, hidden_size=vision_width, intermediate_size=2 * vision_width,
                  num_heads=4, out_hidden_size=hidden_size, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=16,
                  deepstack_visual_indexes=list(deepstack))
    kind = "Qwen3VL" if experts is None else "Qwen3VLMoe"
    config = getattr(transformers, kind + "Config")(
        text_config={**text, **(experts or {})}, vision_config=vision,
        image_token_id=special["<|image_pad|>"],
        video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"],
        vision_end_token_id=special["<|vision_end|>"],
    )
    if tie_word_embeddings is not None:  # the flag transformers ties the head by
        config.tie_word_embeddings = tie_word_embeddings
    torch.manual_seed(seed)
    model = getattr(transformers, kind + "ForConditionalGeneration")(config)
    randomize(model, std=std, seed=seed)
    path = save_checkpoint(model, tokenizer, Path(path), [tokenizer.eos_token_id],
                           **save_kwargs)
    return save_qwen3_vl_processor(path, tokenizer, max_image_tokens)


def save_qwen3_vl_processor(path: Path, tokenizer, max_image_tokens: int) -> Path:
    """Qwen3VLProcessor's settings for the tiny 16-px towers (Qwen3-VL's, Qwen3.5's): images of
    4 to `max_image_tokens` merged patches, videos sampled at 2 fps."""
    import transformers

    unit = 32 * 32  # one merged patch
    image = transformers.Qwen2VLImageProcessorPil(
        patch_size=16, temporal_patch_size=2, merge_size=2,
        size={"shortest_edge": 4 * unit, "longest_edge": max_image_tokens * unit},
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    video = {"video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 16,
             "temporal_patch_size": 2, "merge_size": 2, "fps": 2.0,
             "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
             "size": {"shortest_edge": 8 * unit, "longest_edge": 4 * max_image_tokens * unit}}
    save_processor(path, "Qwen3VLProcessor", tokenizer, image_processor=image,
                   video_settings=video)
    return path
