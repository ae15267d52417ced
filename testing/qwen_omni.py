"""A tiny Qwen2.5-Omni checkpoint for tests and benchmarks: the thinker (audio encoder, vision
tower, Qwen2 decoder with TMRoPE) with random weights, a locally trained tokenizer with the
Omni's media tokens and chat template, and its processor's settings, in transformers 5's layout.

`layout="thinker"` saves Qwen2_5OmniThinkerForConditionalGeneration alone; `layout="omni"` saves
Qwen2_5OmniForConditionalGeneration, the Hub's layout: the thinker under `thinker.`, beside a
tiny talker and token-to-wave model (speech output) that the engine skips.
"""

from __future__ import annotations

from pathlib import Path

import torch

from testing.layouts import save_processor
from testing.tiny import (
    CLIP_MEAN,
    CLIP_STD,
    chatml_template,
    randomize,
    save_checkpoint,
    train_tokenizer,
)

OMNI_SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|vision_bos|>", "<|vision_eos|>", "<|IMAGE|>", "<|VIDEO|>",
    "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>",
]
# The names Qwen2_5OmniProcessor reads its tokens by (the tokenizer's extra special tokens).
OMNI_TOKEN_NAMES = {
    "image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>", "audio_token": "<|AUDIO|>",
    "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
}

# ChatML with the Omni's media placeholders (the layout of Qwen2.5-Omni's own template).
OMNI_CHAT_TEMPLATE = chatml_template(
    "<|vision_bos|><|IMAGE|><|vision_eos|>", "<|vision_bos|><|VIDEO|><|vision_eos|>",
    "<|audio_bos|><|AUDIO|><|audio_eos|>")


def omni_tokenizer(vocab_size: int = 600, kind: str = "bytes"):
    """A tokenizer (`train_tokenizer`'s `kind`) with the Omni's special tokens, named as its
    processor reads them (`tokenizer.image_token`, ...)."""
    from transformers import PreTrainedTokenizerFast

    trained = train_tokenizer(OMNI_SPECIAL, vocab_size, OMNI_CHAT_TEMPLATE, "<|im_end|>", kind)
    extra = {"unk_token": trained.unk_token} if trained.unk_token else {}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=trained.backend_tokenizer, eos_token="<|im_end|>",
        pad_token="<|endoftext|>", extra_special_tokens=OMNI_TOKEN_NAMES, **extra)
    tok.chat_template = OMNI_CHAT_TEMPLATE
    return tok


def thinker_config(tokenizer, *, hidden_size: int = 64, num_layers: int = 2, heads: int = 4,
                   kv_heads: int = 2, intermediate_size: int | None = None,
                   vision_width: int = 32, vision_depth: int = 2, vision_heads: int = 4,
                   vision_intermediate: int | None = None, vision_window: int = 56,
                   audio_width: int = 32,
                   audio_layers: int = 2, audio_heads: int = 4, audio_ffn: int | None = None,
                   tie_word_embeddings: bool | None = None):
    """Qwen2_5OmniThinkerConfig of the tiny shapes (or those given), token ids from
    `tokenizer`."""
    from transformers import Qwen2_5OmniThinkerConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in OMNI_SPECIAL}
    half = hidden_size // heads // 2
    section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
    text = dict(
        hidden_size=hidden_size, intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        vocab_size=len(tokenizer),
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "mrope_section": section, "rope_theta": 1e6},
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(depth=vision_depth + 1, hidden_size=vision_width, out_hidden_size=hidden_size,
                  intermediate_size=vision_intermediate or vision_width * 3 // 2,
                  num_heads=vision_heads, window_size=vision_window,
                  fullatt_block_indexes=[1])
    audio = dict(d_model=audio_width, encoder_layers=audio_layers,
                 encoder_attention_heads=audio_heads, encoder_ffn_dim=audio_ffn or 2 * audio_width,
                 num_mel_bins=128, max_source_positions=1500, n_window=100,
                 output_dim=hidden_size)
    config = Qwen2_5OmniThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio,
        audio_token_index=ids["<|AUDIO|>"], image_token_index=ids["<|IMAGE|>"],
        video_token_index=ids["<|VIDEO|>"], audio_start_token_id=ids["<|audio_bos|>"],
        audio_end_token_id=ids["<|audio_eos|>"], position_id_per_seconds=25,
        seconds_per_chunk=2,
    )
    # Read by get_rope_index, not declared by the config class (the Hub's config.json has them).
    config.vision_start_token_id = ids["<|vision_bos|>"]
    config.vision_end_token_id = ids["<|vision_eos|>"]
    if tie_word_embeddings is not None:
        config.tie_word_embeddings = tie_word_embeddings
    return config


def build_qwen_omni_model(path: Path, *, layout: str = "thinker", seed: int = 0,
                          std: float = 0.25, max_image_tokens: int = 64,
                          tie_word_embeddings: bool | None = None,
                          tokenizer_kind: str = "bytes", **shapes) -> Path:
    """Save a tiny Qwen2.5-Omni checkpoint (see the module docstring) and return its path.

    Images are kept small (4 to `max_image_tokens` merged patches); videos follow the Omni
    processor's own pixel budget (its class default, which overrides the video processor's).
    `tokenizer_kind` is the kind of `train_tokenizer`."""
    import transformers

    if layout not in ("thinker", "omni"):
        raise ValueError(f"unknown layout {layout!r} (thinker, omni)")
    tokenizer = omni_tokenizer(kind=tokenizer_kind)
    thinker = thinker_config(tokenizer, tie_word_embeddings=tie_word_embeddings, **shapes)
    torch.manual_seed(seed)
    if layout == "thinker":
        model = transformers.Qwen2_5OmniThinkerForConditionalGeneration(thinker)
    else:
        config = transformers.Qwen2_5OmniConfig(
            thinker_config=thinker.to_dict(), talker_config=_tiny_talker(thinker),
            token2wav_config=_TINY_TOKEN2WAV, enable_audio_output=True)
        model = transformers.Qwen2_5OmniForConditionalGeneration(config)
    randomize(model, std=std, seed=seed)
    path = save_checkpoint(model, tokenizer, Path(path), [tokenizer.eos_token_id])
    if layout == "omni":  # the speakers of the speech output (transformers loads the file)
        torch.save({}, path / "spk_dict.pt")
    unit = 28 * 28  # one merged patch
    image = transformers.Qwen2VLImageProcessorPil(
        patch_size=14, temporal_patch_size=2, merge_size=2, image_mean=CLIP_MEAN,
        image_std=CLIP_STD, size={"shortest_edge": 4 * unit,
                                  "longest_edge": max_image_tokens * unit})
    video = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 14,
             "temporal_patch_size": 2, "merge_size": 2, "image_mean": list(CLIP_MEAN),
             "image_std": list(CLIP_STD),
             "size": {"shortest_edge": 4 * unit, "longest_edge": 16 * unit}}
    features = transformers.WhisperFeatureExtractor(feature_size=128,
                                                    return_attention_mask=True)
    save_processor(path, "Qwen2_5OmniProcessor", tokenizer, image_processor=image,
                   video_settings=video, components={"feature_extractor": features.to_dict()})
    return path


def _tiny_talker(thinker) -> dict:
    text = thinker.text_config
    return dict(
        vocab_size=64, embedding_size=text.hidden_size, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        text_vocab_size=text.vocab_size, audio_token_index=thinker.audio_token_id,
        image_token_index=thinker.image_token_id, video_token_index=thinker.video_token_id,
        rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1],
                         "rope_theta": 1e6},
        # Token ids inside the tiny vocabularies (the defaults are the real model's).
        tts_text_start_token_id=60, tts_text_end_token_id=61, tts_text_pad_token_id=59,
        tts_codec_start_token_id=62, tts_codec_end_token_id=63, tts_codec_pad_token_id=58,
        tts_codec_mask_token_id=57, vision_start_token_id=thinker.vision_start_token_id,
        vision_end_token_id=thinker.vision_end_token_id,
        audio_start_token_id=thinker.audio_start_token_id,
        audio_end_token_id=thinker.audio_end_token_id,
    )


_TINY_TOKEN2WAV = {
    "dit_config": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, head_dim=16,
                       emb_dim=16, enc_emb_dim=16, enc_dim=16, enc_channels=[16, 16, 16, 16, 48],
                       enc_attention_channels=8, enc_se_channels=8, num_embeds=64, mel_dim=8,
                       look_ahead_layers=[1], look_backward_layers=[0]),
    "bigvgan_config": dict(mel_dim=8, upsample_initial_channel=16,
                           resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3, 5]],
                           upsample_rates=[2], upsample_kernel_sizes=[4]),
}


# ---- transformers' inputs for a prompt the engine processed (tests and benchmarks) --------


def items_in_order(proc, media):
    """(modality, item features, decoded item) per media item, in prompt order."""
    features = sorted(proc.mm_features, key=lambda f: f.placeholder.offset)
    order, by_item = [], {}
    for f in features:
        if f.item not in by_item:
            by_item[f.item] = []
            order.append(f.item)
        by_item[f.item].append(f)
    queues = {m: iter(media.get(m, [])) for m in ("image", "video", "audio")}
    return [(by_item[i][0].modality, by_item[i], next(queues[by_item[i][0].modality]))
            for i in order]


def reference_inputs(proc, media) -> dict:
    """transformers' generate() inputs for our processed prompt `proc` (and its decoded
    `media`): our ids, our pixel values (the tests check them against transformers' image
    path), transformers' own log-mel features of the clips in prompt order, and the video
    settings its positions need (`use_audio_in_video` when a video is heard)."""
    ids = torch.tensor([proc.token_ids])
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    images, videos, grids, seconds, clips, heard = [], [], [], [], [], False
    for modality, features, item in items_in_order(proc, media):
        if modality == "image":
            images.append(features[0].data)
        elif modality == "audio":
            clips.append(item.samples)
        else:
            patches = [f.data for f in features if f.modality == "video"]
            videos.append(torch.cat([d["pixel_values"] for d in patches]))
            grids.append((len(patches), *patches[0]["grid_thw"][1:]))
            seconds.append(2 / item.sampled_fps)
            if any(f.modality == "audio" for f in features):
                clips.append(item.audio.samples)
                heard = True
    if images:
        kwargs["pixel_values"] = torch.cat([d["pixel_values"] for d in images])
        kwargs["image_grid_thw"] = torch.tensor([d["grid_thw"] for d in images])
    if videos:
        kwargs.update(pixel_values_videos=torch.cat(videos), video_grid_thw=torch.tensor(grids),
                      video_second_per_grid=torch.tensor(seconds), use_audio_in_video=heard)
    if clips:
        import transformers

        mel = transformers.WhisperFeatureExtractor(feature_size=128)(
            clips, sampling_rate=16000, padding="max_length", return_attention_mask=True,
            return_tensors="pt")
        kwargs.update(input_features=mel["input_features"],
                      feature_attention_mask=mel["attention_mask"])
    return kwargs
