"""Tiny random-weight LLaVA-1.5 and LLaVA-NeXT checkpoints (CLIP or SigLIP tower, Llama or
Mistral decoder), with a tokenizer that knows `<image>` and the preprocessor config of
transformers' own image processor for the family."""

from __future__ import annotations

from pathlib import Path

import torch

from testing.tiny import randomize, save_checkpoint, train_tokenizer

LLAVA_SPECIAL = ["<pad>", "<s>", "</s>", "<image>"]
# Vicuna-style turns, as llava-1.5's template; `<image>` where an image part stands.
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n"
    "{% else %}{{ message['role'].upper() }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
TILE = 56  # the tower's input size: 4 x 4 patches of 14 pixels
PINPOINTS = [[56, 112], [112, 56], [112, 112], [168, 56], [56, 168]]


def llava_tokenizer(vocab_size: int = 600, kind: str = "bytes",
                    added_special: tuple[str, ...] = ()):
    return train_tokenizer([*LLAVA_SPECIAL, *added_special], vocab_size, LLAVA_CHAT_TEMPLATE,
                           "</s>", kind)


def build_llava_model(
    path: Path,
    *,
    next_: bool = False,
    tower: str = "clip",
    text: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    vision_width: int = 32,
    vision_depth: int = 3,
    seed: int = 0,
    std: float = 0.25,
    tokenizer_kind: str = "bytes",
    tie_word_embeddings: bool | None = None,
    added_special: tuple[str, ...] = (),
) -> Path:
    """A tiny LlavaForConditionalGeneration (or LlavaNextForConditionalGeneration with
    `next_`), its tokenizer ("bytes" or the demo's "words", see testing.tiny.train_tokenizer;
    `added_special`: more special tokens, such as Mistral's control tokens), and the
    preprocessor config of its transformers image processor."""
    import transformers

    tokenizer = llava_tokenizer(kind=tokenizer_kind, added_special=tuple(added_special))
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    text_cfg = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig}[text](
        hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=len(tokenizer),
        max_position_embeddings=2048, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
        **({"sliding_window": None} if text == "mistral" else {}),
    )
    vision = dict(hidden_size=vision_width, intermediate_size=2 * vision_width,
                  num_hidden_layers=vision_depth, num_attention_heads=4, image_size=TILE,
                  patch_size=14)
    if tower == "clip":
        vision_cfg, strategy = transformers.CLIPVisionConfig(**vision), "default"
        processor = _clip_processor(next_)
    elif tower == "siglip":
        vision_cfg, strategy = transformers.SiglipVisionConfig(**vision), "full"
        processor = transformers.SiglipImageProcessorPil(size={"height": TILE, "width": TILE})
    else:
        raise ValueError(f"unknown tower {tower!r} (clip, siglip)")
    common = dict(text_config=text_cfg, vision_config=vision_cfg, image_token_index=image_id,
                  vision_feature_layer=-2, vision_feature_select_strategy=strategy,
                  projector_hidden_act="gelu")
    if next_:
        if tower != "clip":
            processor = _clip_processor(True)
        config = transformers.LlavaNextConfig(**common, image_grid_pinpoints=PINPOINTS)
        cls = transformers.LlavaNextForConditionalGeneration
    else:
        config, cls = transformers.LlavaConfig(**common), transformers.LlavaForConditionalGeneration
    if tie_word_embeddings is not None:  # the flag transformers ties the head by
        config.tie_word_embeddings = tie_word_embeddings
    torch.manual_seed(seed)
    model = cls(config)
    randomize(model, std=std, seed=seed)
    path = save_checkpoint(model, tokenizer, Path(path), [tokenizer.eos_token_id])
    # The processor as transformers writes it: its image processor nested in
    # processor_config.json beside its own fields (testing.layouts rewrites older layouts).
    processor_cls = (transformers.LlavaNextProcessor if next_ else transformers.LlavaProcessor)
    processor_cls(image_processor=processor, tokenizer=tokenizer, patch_size=14,
                  vision_feature_select_strategy=strategy,
                  num_additional_image_tokens=int(tower == "clip"),
                  chat_template=tokenizer.chat_template).save_pretrained(path)
    return path


def _clip_processor(anyres: bool):
    import transformers

    options = dict(size={"shortest_edge": TILE}, crop_size={"height": TILE, "width": TILE})
    if anyres:
        return transformers.LlavaNextImageProcessorPil(**options, image_grid_pinpoints=PINPOINTS)
    return transformers.CLIPImageProcessorPil(**options)
