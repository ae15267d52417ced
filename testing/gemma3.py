"""Tiny random-weight Gemma 3 checkpoints: Gemma3ForConditionalGeneration (SigLIP tower) with a
tokenizer that knows Gemma's turn and image tokens, Gemma's chat template (a system prompt folds
into the first user turn) and `<end_of_turn>` as EOS in generation_config.json."""

from __future__ import annotations

from pathlib import Path

import torch

from testing.tiny import randomize, save_checkpoint, train_tokenizer

GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>",
                 "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ prefix if loop.first else '' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<start_of_image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
GEMMA3_TEXT = {  # Gemma 3's proportions shrunk: 6 layers, 5 local : 1 global
    "head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 12,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    "hidden_activation": "gelu_pytorch_tanh",
}


def gemma_tokenizer(vocab_size: int = 600):
    from transformers import PreTrainedTokenizerFast

    tok = train_tokenizer(GEMMA_SPECIAL, vocab_size, GEMMA_CHAT_TEMPLATE, "<end_of_turn>")
    # Gemma's tokenizer names its image tokens (transformers' Gemma3Processor reads them).
    gemma = PreTrainedTokenizerFast(
        tokenizer_object=tok.backend_tokenizer, eos_token="<end_of_turn>", pad_token="<pad>",
        bos_token="<bos>", extra_special_tokens={
            "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>"},
    )
    gemma.chat_template = GEMMA_CHAT_TEMPLATE
    return gemma


def build_gemma3_model(
    path: Path,
    *,
    hidden_size: int = 64,
    vision_width: int = 32,
    image_size: int = 56,
    patch_size: int = 7,
    mm_tokens_per_image: int = 16,
    pan_and_scan: dict | None = None,
    seed: int = 0,
    std: float = 0.25,
    tie_word_embeddings: bool | None = None,
    vision_use_head: bool = True,
    text_overrides: dict | None = None,
) -> Path:
    """A tiny Gemma3ForConditionalGeneration at `path` with its Gemma3Processor; `pan_and_scan`
    options go to the image processor's config (e.g. {"do_pan_and_scan": True}), where
    transformers' processor overrides them with its own defaults unless a call passes them.
    `vision_use_head=False`: the SigLIP tower without its pooling head, as Gemma 3's own
    checkpoints are (the model never reads the head); `text_overrides` go to the text config
    (over GEMMA3_TEXT)."""
    import transformers

    tokenizer = gemma_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GEMMA_SPECIAL}
    text = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
        max_position_embeddings=2048, pad_token_id=ids["<pad>"], eos_token_id=ids["<eos>"],
        bos_token_id=ids["<bos>"], **(GEMMA3_TEXT | (text_overrides or {})),
    )
    vision = transformers.SiglipVisionConfig(
        hidden_size=vision_width, intermediate_size=2 * vision_width, num_hidden_layers=2,
        num_attention_heads=4, image_size=image_size, patch_size=patch_size,
        vision_use_head=vision_use_head,
    )
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=mm_tokens_per_image,
        boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
        image_token_index=ids["<image_soft_token>"],
    )
    if tie_word_embeddings is not None:  # the flag transformers ties the head by
        config.tie_word_embeddings = tie_word_embeddings
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config)
    randomize(model, std=std, seed=seed)
    path = save_checkpoint(model, tokenizer, Path(path),
                           [ids["<end_of_turn>"], ids["<eos>"]])
    image_processor = transformers.Gemma3ImageProcessorPil(
        size={"height": image_size, "width": image_size}, **(pan_and_scan or {}))
    transformers.Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer,
        image_seq_length=mm_tokens_per_image, chat_template=tokenizer.chat_template,
    ).save_pretrained(path)
    return path
