"""Tiny random-weight SmolVLM (SmolVLMForConditionalGeneration) and Idefics3
(Idefics3ForConditionalGeneration) checkpoints: SigLIP-style tower on 32-pixel tiles (16 tokens
a tile after the pixel shuffle), Llama decoder, a tokenizer with the image structure tokens
(`<fake_token_around_image>`, `<global-img>`, `<row_i_col_j>`) and SmolVLM2's chat template,
the image processor's config and, for SmolVLM, the video processor's sampling settings."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from testing.tiny import randomize, save_checkpoint, train_tokenizer

ROW_COL = [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
SMOLVLM_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>",
                   "<fake_token_around_image>", "<image>", "<global-img>", "<video>", *ROW_COL]
# SmolVLM2's template ("User:" right before a leading image), taking string contents too.
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}: {{ message['content'] }}"
    "{% else %}{% if message['content'][0]['type'] == 'image' %}{{ ':' }}"
    "{% else %}{{ ': ' }}{% endif %}{% for line in message['content'] %}"
    "{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}"
    "{% elif line['type'] == 'video' %}{{ '<video>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
TILE = 32
PATCH = 4
TOKENS_PER_TILE = (TILE // PATCH // 2) ** 2


def smolvlm_tokenizer(vocab_size: int = 600):
    return train_tokenizer(SMOLVLM_SPECIAL, vocab_size, SMOLVLM_CHAT_TEMPLATE,
                           "<end_of_utterance>")


def build_smolvlm_model(
    path: Path,
    *,
    arch: str = "smolvlm",
    longest_edge: int = 3 * TILE,
    max_frames: int = 8,
    hidden_size: int = 64,
    vision_width: int = 32,
    seed: int = 0,
    std: float = 0.25,
    tie_word_embeddings: bool | None = None,
) -> Path:
    """A tiny SmolVLMForConditionalGeneration (`arch` "smolvlm") or
    Idefics3ForConditionalGeneration ("idefics3") at `path`; images are resized to
    `longest_edge` then cut into 32-pixel tiles."""
    import transformers
    from transformers.models.idefics3 import Idefics3VisionConfig
    from transformers.models.smolvlm import SmolVLMVisionConfig

    tokenizer = smolvlm_tokenizer()
    text = transformers.LlamaConfig(
        hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
        max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(hidden_size=vision_width, intermediate_size=2 * vision_width,
                  num_hidden_layers=2, num_attention_heads=4, image_size=TILE, patch_size=PATCH)
    common = dict(text_config=text, scale_factor=2,
                  image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    sizes = dict(size={"longest_edge": longest_edge}, max_image_size={"longest_edge": TILE})
    if arch == "smolvlm":
        config = transformers.SmolVLMConfig(vision_config=SmolVLMVisionConfig(**vision), **common)
        cls, processor = (transformers.SmolVLMForConditionalGeneration,
                          transformers.SmolVLMImageProcessorPil(**sizes))
    elif arch == "idefics3":
        config = transformers.Idefics3Config(vision_config=Idefics3VisionConfig(**vision),
                                             **common)
        cls, processor = (transformers.Idefics3ForConditionalGeneration,
                          transformers.Idefics3ImageProcessorPil(**sizes))
    else:
        raise ValueError(f"unknown arch {arch!r} (smolvlm, idefics3)")
    if tie_word_embeddings is not None:  # the flag transformers ties the head by
        config.tie_word_embeddings = tie_word_embeddings
    torch.manual_seed(seed)
    model = cls(config)
    randomize(model, std=std, seed=seed)
    path = save_checkpoint(model, tokenizer, Path(path), [tokenizer.eos_token_id])
    per_tile = (TILE // PATCH // 2) ** 2
    if arch == "idefics3":
        transformers.Idefics3Processor(
            image_processor=processor, tokenizer=tokenizer, image_seq_len=per_tile,
            chat_template=tokenizer.chat_template).save_pretrained(path)
    else:
        # SmolVLMProcessor cannot be built without torchvision (its video processor needs it),
        # so its processor_config.json is assembled as transformers 5 writes it: the image
        # processor's own to_dict(), the video processor's settings (what SmolVLMVideoProcessor
        # reads), the processor's own field and class.
        video = {"video_sampling": {"fps": 1, "max_frames": max_frames,
                                    "video_size": {"longest_edge": longest_edge}},
                 "max_image_size": {"longest_edge": TILE}, "do_sample_frames": True,
                 "resample": processor.resample, "video_processor_type": "SmolVLMVideoProcessor"}
        config = {"image_processor": processor.to_dict(), "video_processor": video,
                  "image_seq_len": per_tile, "processor_class": "SmolVLMProcessor"}
        (path / "processor_config.json").write_text(json.dumps(config, indent=2))
    return path
