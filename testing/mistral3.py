"""Tiny random-weight Mistral Small 3.1 checkpoints (Mistral3ForConditionalGeneration: Pixtral
tower, merging projector, Mistral decoder), or LLaVA with a Pixtral tower, with a tokenizer
that knows Pixtral's image tokens, a Mistral-style chat template and the preprocessor config of
transformers' PixtralImageProcessor; and transformers' PixtralProcessor as a test reference."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

from testing.tiny import randomize, save_checkpoint, train_tokenizer

MISTRAL_SPECIAL = ["<pad>", "<s>", "</s>", "[INST]", "[/INST]", "[IMG]", "[IMG_BREAK]",
                   "[IMG_END]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
# Mistral's instruct layout (v7): `[IMG]` where an image part stands.
MISTRAL_CHAT_TEMPLATE = (
    "<s>{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "[SYSTEM_PROMPT]{{ message['content'] }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}[IMG]"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}[/INST]"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}</s>"
    "{% endif %}{% endfor %}"
)
PATCH = 14
LONGEST_EDGE = 168  # at most 6 x 6 embeddings of 28 x 28 pixels (merge 2)


def mistral_tokenizer(vocab_size: int = 600):
    return train_tokenizer(MISTRAL_SPECIAL, vocab_size, MISTRAL_CHAT_TEMPLATE, "</s>")


def build_mistral3_model(
    path: Path,
    *,
    llava: bool = False,
    hidden_size: int = 64,
    num_layers: int = 2,
    vision_width: int = 32,
    vision_depth: int = 2,
    feature_layer: int | list[int] = -1,
    seed: int = 0,
    std: float = 0.25,
    tie_word_embeddings: bool | None = None,
) -> Path:
    """A tiny Mistral3ForConditionalGeneration (LlavaForConditionalGeneration with a Pixtral
    tower and no merger with `llava`), its tokenizer and preprocessor config."""
    import transformers

    tokenizer = mistral_tokenizer()
    text_cfg = transformers.MistralConfig(
        hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden_size // 4,
        vocab_size=len(tokenizer), max_position_embeddings=2048, sliding_window=None,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    vision_cfg = transformers.PixtralVisionConfig(
        hidden_size=vision_width, intermediate_size=2 * vision_width,
        num_hidden_layers=vision_depth, num_attention_heads=4, image_size=LONGEST_EDGE,
        patch_size=PATCH, rope_parameters={"rope_type": "axial", "rope_theta": 10000.0},
    )
    common = dict(text_config=text_cfg, vision_config=vision_cfg,
                  vision_feature_layer=feature_layer,
                  image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
                  projector_hidden_act="gelu", tie_word_embeddings=False)
    if llava:
        config = transformers.LlavaConfig(**common, vision_feature_select_strategy="full",
                                          multimodal_projector_bias=True)
        cls = transformers.LlavaForConditionalGeneration
    else:
        config = transformers.Mistral3Config(**common, spatial_merge_size=2)
        cls = transformers.Mistral3ForConditionalGeneration
    if tie_word_embeddings is not None:  # the flag transformers ties the head by
        config.tie_word_embeddings = tie_word_embeddings
    torch.manual_seed(seed)
    model = cls(config)
    randomize(model, std=std, seed=seed)
    path = save_checkpoint(model, tokenizer, Path(path), [tokenizer.eos_token_id])
    image_processor = transformers.PixtralImageProcessorPil(
        patch_size={"height": PATCH, "width": PATCH}, size={"longest_edge": LONGEST_EDGE})
    pixtral_processor_class()(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH,
        spatial_merge_size=1 if llava else 2, chat_template=tokenizer.chat_template,
    ).save_pretrained(path)
    return path


def hf_pixtral_processor(path: Path, merge: int):
    """transformers' PixtralProcessor over the checkpoint's tokenizer and PIL image processor
    (see `pixtral_processor_class`)."""
    import transformers

    return pixtral_processor_class()(
        image_processor=transformers.PixtralImageProcessorPil.from_pretrained(path),
        tokenizer=transformers.AutoTokenizer.from_pretrained(path),
        patch_size=PATCH, spatial_merge_size=merge,
    )


def pixtral_processor_class():
    """transformers' PixtralProcessor class.

    Its module refuses to import without torchvision (which these machines lack), although
    nothing in it needs torchvision once the PIL image processor is handed in: it is loaded
    from its source with that guard removed and the size helper taken from the PIL module.
    """
    import transformers.models.pixtral as package

    name = "transformers.models.pixtral._processing_pixtral_pil"
    if name not in sys.modules:
        file = Path(package.__file__).parent / "processing_pixtral.py"
        source = file.read_text().replace('@requires(backends=("torchvision", "torch"))', "")
        source = source.replace("from .image_processing_pixtral import",
                                "from .image_processing_pil_pixtral import")
        module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, None))
        module.__package__, module.__file__ = package.__name__, str(file)
        sys.modules[name] = module
        exec(compile(source, str(file), "exec"), module.__dict__)
    return sys.modules[name].PixtralProcessor
