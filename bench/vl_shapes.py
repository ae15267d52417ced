"""Bench-only: random-weight multimodal checkpoints at real models' widths (Qwen2.5-VL-3B,
Qwen3-VL-2B, Gemma 3 4B; Qwen2-Audio-7B), at full depth or cut to fewer decoder layers and tower
(or audio encoder) blocks, saved in bfloat16 with their processor settings and a locally
trained tokenizer. Built once per shape and cached (bench.common.cache_dir).

The widths are the Hub configs'; weights are transformers' own initialisation (std 0.02), so
activations have realistic scales. Media keep the processors' real budgets (Qwen-VL: up to
12845056 pixels; Gemma 3: 896 px, 256 tokens; Qwen2-Audio: 30 s windows of 750 tokens), which
is what a media turn costs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.common import cache_dir


@dataclass(frozen=True)
class Shape:
    """One family at real widths: its full depths and how to build it cut to (layers, blocks)."""

    name: str
    layers: int  # decoder layers at full depth
    blocks: int  # vision tower blocks at full depth
    build: Callable[[Path, int, int], None]
    # The text that stands for one media item in the rendered chat prompt (replaced by
    # llama.cpp's media marker: libmtmd writes the family's delimiters itself).
    media_text: str
    media: str = "image"  # or "audio"
    # The context both sides get (the KV cache is sized for it): room for the largest image the
    # preprocessor accepts (Qwen3-VL: 16384 embeddings); for the audio model two 30 s windows.
    context: int = 16384


def _qwen2_5_vl_3b(path: Path, layers: int, blocks: int) -> None:
    import transformers

    from testing.tiny import CLIP_MEAN, CLIP_STD, QWEN_SPECIAL, qwen_tokenizer

    tok = qwen_tokenizer()
    special = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=2048, intermediate_size=11008, num_hidden_layers=layers,
            num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
            max_position_embeddings=128000, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24],
                             "rope_theta": 1e6},
            eos_token_id=tok.eos_token_id, bos_token_id=None,
            pad_token_id=special["<|endoftext|>"]),
        vision_config=dict(
            depth=blocks, hidden_size=1280, intermediate_size=3420, num_heads=16,
            out_hidden_size=2048, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
            window_size=112, tokens_per_second=2,
            # full attention every 8th block (7, 15, 23, 31), the last kept when cut shorter
            fullatt_block_indexes=[i for i in (7, 15, 23, 31) if i < blocks] or [blocks - 1]),
        image_token_id=special["<|image_pad|>"], video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"],
        vision_end_token_id=special["<|vision_end|>"], tie_word_embeddings=True,
    )
    image = transformers.Qwen2VLImageProcessorPil(
        patch_size=14, temporal_patch_size=2, merge_size=2, image_mean=CLIP_MEAN,
        image_std=CLIP_STD, size={"shortest_edge": 3136, "longest_edge": 12845056})
    video = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 14,
             "temporal_patch_size": 2, "merge_size": 2, "fps": 2.0,
             "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD),
             "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}}
    _save(path, transformers.Qwen2_5_VLForConditionalGeneration, config, tok,
          "Qwen2_5_VLProcessor", image, video)


def _qwen3_vl_2b(path: Path, layers: int, blocks: int) -> None:
    import transformers

    from testing.tiny import QWEN_SPECIAL, qwen_tokenizer

    tok = qwen_tokenizer()
    special = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    config = transformers.Qwen3VLConfig(
        text_config=dict(
            hidden_size=2048, intermediate_size=6144, num_hidden_layers=layers,
            num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
            max_position_embeddings=262144, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                             "mrope_section": [24, 20, 20], "mrope_interleaved": True},
            eos_token_id=tok.eos_token_id, bos_token_id=None,
            pad_token_id=special["<|endoftext|>"]),
        vision_config=dict(
            depth=blocks, hidden_size=1024, intermediate_size=4096, num_heads=16,
            out_hidden_size=2048, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
            num_position_embeddings=2304,
            deepstack_visual_indexes=[i for i in (5, 11, 17) if i < blocks] or [blocks - 1]),
        image_token_id=special["<|image_pad|>"], video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"],
        vision_end_token_id=special["<|vision_end|>"], tie_word_embeddings=True,
    )
    unit = 32 * 32
    image = transformers.Qwen2VLImageProcessorPil(
        patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
        image_std=[0.5] * 3, size={"shortest_edge": 64 * unit, "longest_edge": 16384 * unit})
    video = {"video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 16,
             "temporal_patch_size": 2, "merge_size": 2, "fps": 2.0,
             "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
             "size": {"shortest_edge": 128 * unit, "longest_edge": 768 * unit}}
    _save(path, transformers.Qwen3VLForConditionalGeneration, config, tok, "Qwen3VLProcessor",
          image, video)


def _gemma3_4b(path: Path, layers: int, blocks: int) -> None:
    import transformers

    from testing.gemma3 import GEMMA_SPECIAL, gemma_tokenizer

    tok = gemma_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in GEMMA_SPECIAL}
    pattern = ["sliding_attention"] * 5 + ["full_attention"]
    text = transformers.Gemma3TextConfig(
        vocab_size=262208, hidden_size=2560, intermediate_size=10240,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=1024, max_position_embeddings=131072,
        layer_types=[pattern[i % 6] for i in range(layers)],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
        hidden_activation="gelu_pytorch_tanh", pad_token_id=ids["<pad>"],
        eos_token_id=ids["<eos>"], bos_token_id=ids["<bos>"])
    vision = transformers.SiglipVisionConfig(
        hidden_size=1152, intermediate_size=4304, num_hidden_layers=blocks,
        num_attention_heads=16, image_size=896, patch_size=14, vision_use_head=False,
        layer_norm_eps=1e-6)
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=256,
        boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"], tie_word_embeddings=True)
    image = transformers.Gemma3ImageProcessorPil(
        size={"height": 896, "width": 896}, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        resample=2, do_pan_and_scan=False)
    _save(path, transformers.Gemma3ForConditionalGeneration, config, tok, "Gemma3Processor",
          image, None, fields={"image_seq_length": 256})


def _qwen2_audio_7b(path: Path, layers: int, blocks: int) -> None:
    import transformers

    from testing.tiny import qwen_tokenizer

    tok = qwen_tokenizer()
    config = transformers.Qwen2AudioConfig(
        audio_config=dict(d_model=1280, encoder_layers=blocks, encoder_attention_heads=20,
                          encoder_ffn_dim=5120, num_mel_bins=128, max_source_positions=1500),
        text_config=dict(
            hidden_size=4096, intermediate_size=11008, num_hidden_layers=layers,
            num_attention_heads=32, num_key_value_heads=32, vocab_size=156032,
            max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=10000.0,
            eos_token_id=tok.eos_token_id, bos_token_id=None,
            pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>")),
        audio_token_index=tok.convert_tokens_to_ids("<|AUDIO|>"))
    _save_model(path, transformers.Qwen2AudioForConditionalGeneration, config, tok)
    transformers.Qwen2AudioProcessor(
        feature_extractor=transformers.WhisperFeatureExtractor(
            feature_size=128, return_attention_mask=True),
        tokenizer=tok, chat_template=tok.chat_template).save_pretrained(path)


def _save(path: Path, cls, config, tok, processor: str, image, video,
          fields: dict | None = None) -> None:
    from testing.layouts import save_processor

    _save_model(path, cls, config, tok)
    save_processor(path, processor, tok, image_processor=image, video_settings=video,
                   fields=fields)


def _save_model(path: Path, cls, config, tok) -> None:
    from testing.tiny import save_checkpoint

    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # a 3B model initialised in float32 would be 15 GB
    try:
        torch.manual_seed(0)
        model = cls(config)
    finally:
        torch.set_default_dtype(default)
    model.config.dtype = torch.bfloat16
    save_checkpoint(model, tok, path, [tok.eos_token_id], max_shard_size="2GB")


SHAPES = {
    "qwen2.5-vl-3b": Shape("qwen2.5-vl-3b", 36, 32, _qwen2_5_vl_3b,
                           "<|vision_start|><|image_pad|><|vision_end|>"),
    "qwen3-vl-2b": Shape("qwen3-vl-2b", 28, 24, _qwen3_vl_2b,
                         "<|vision_start|><|image_pad|><|vision_end|>"),
    "gemma3-4b": Shape("gemma3-4b", 34, 27, _gemma3_4b, "<start_of_image>"),
    "qwen2-audio-7b": Shape("qwen2-audio-7b", 32, 32, _qwen2_audio_7b,
                            "<|audio_bos|><|AUDIO|><|audio_eos|>", media="audio", context=2048),
}


def build(name: str, layers: int | None = None, blocks: int | None = None) -> Path:
    """The checkpoint of shape `name` cut to `layers` decoder layers and `blocks` tower (or
    audio encoder) blocks (None: full depth), built once."""
    shape = SHAPES[name]
    layers, blocks = layers or shape.layers, blocks or shape.blocks
    if blocks < 3:
        raise ValueError("llama.cpp's converter needs at least 3 tower blocks")
    path = cache_dir(f"{name}-L{layers}-V{blocks}")
    if not (path / "config.json").exists():
        print(f"building a random {name} checkpoint ({layers} layers, {blocks} tower blocks) "
              f"in {path} (once)")
        shape.build(path, layers, blocks)
    return path
