"""Tiny random-weight Llama 3.2 Vision checkpoints (MllamaForConditionalGeneration), laid out as
Meta's: the image token is the first id past the text vocabulary (embedded by the 8 extra rows,
not produced by the LM head), the tokenizer adds BOS itself, a Llama 3 chat template that writes
`<|image|>` where an image part stands, and transformers' MllamaProcessor saved beside it.

`zero_text_rows` makes a transformers model compute what Meta's model computes for rows that
attend to no image (text before the first one): see its docstring.
"""

from __future__ import annotations

from pathlib import Path

import torch

from testing.tiny import LLAMA_SPECIAL, randomize, save_checkpoint, train_tokenizer

IMAGE_TOKEN = "<|image|>"
MLLAMA_CHAT_TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def mllama_tokenizer(vocab_size: int = 600, kind: str = "bytes"):
    """Llama 3's special tokens, BOS added by the tokenizer, and `<|image|>` added last."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    base = train_tokenizer(LLAMA_SPECIAL, vocab_size, MLLAMA_CHAT_TEMPLATE, "<|eot_id|>", kind)
    backend = base.backend_tokenizer
    bos = "<|begin_of_text|>"
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, base.convert_tokens_to_ids(bos))])
    extra = {"unk_token": base.unk_token} if base.unk_token else {}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token="<|eot_id|>",
                                  pad_token="<|end_of_text|>", **extra)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tok.chat_template = MLLAMA_CHAT_TEMPLATE
    return tok


def build_mllama_model(
    path: Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 5,
    cross_attention_layers: tuple[int, ...] = (1, 3),
    vision_width: int = 32,
    image_size: int = 28,
    patch_size: int = 7,
    max_tiles: int = 4,
    seed: int = 0,
    std: float = 0.25,
    tokenizer_kind: str = "bytes",
    tie_word_embeddings: bool | None = None,
) -> Path:
    """A tiny MllamaForConditionalGeneration at `path` with its MllamaProcessor: tiles of
    `image_size` pixels, 17 positions each at the defaults (16 patches and the class token; not
    a multiple of 8, as the real 1601 is not), a 4-layer local and 2-layer global tower.
    `tie_word_embeddings` sets the text config's flag (transformers' class ties nothing)."""
    import transformers

    tokenizer = mllama_tokenizer(kind=tokenizer_kind)
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("bos_token_id", "<|begin_of_text|>"), ("eos_token_id", "<|eot_id|>"),
        ("pad_token_id", "<|end_of_text|>"))}
    text = transformers.MllamaTextConfig(
        vocab_size=image_id, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        cross_attention_layers=list(cross_attention_layers), max_position_embeddings=2048,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 256},
        tie_word_embeddings=bool(tie_word_embeddings), **ids)
    vision = transformers.MllamaVisionConfig(
        hidden_size=vision_width, intermediate_size=2 * vision_width, num_hidden_layers=4,
        num_global_layers=2, attention_heads=4, image_size=image_size, patch_size=patch_size,
        max_num_tiles=max_tiles, intermediate_layers_indices=[0, 2],
        vision_output_dim=3 * vision_width)
    config = transformers.MllamaConfig(text_config=text, vision_config=vision,
                                       image_token_index=image_id)
    torch.manual_seed(seed)
    model = transformers.MllamaForConditionalGeneration(config)
    randomize(model, std=std, seed=seed)
    _open_gates(model, seed)
    path = save_checkpoint(model, tokenizer, Path(path), [ids["eos_token_id"]])
    image_processor = transformers.MllamaImageProcessorPil(
        size={"height": image_size, "width": image_size}, max_image_tiles=max_tiles)
    transformers.MllamaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                 chat_template=tokenizer.chat_template).save_pretrained(path)
    return path


@torch.no_grad()
def _open_gates(model, seed: int) -> None:
    """The tanh gates (cross-attention, global layers, tile and position blends) start at zero
    in transformers, which would hide the paths they gate: draw them N(0, 1) instead."""
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if name.split(".")[-1] in ("cross_attn_attn_gate", "cross_attn_mlp_gate", "gate_attn",
                                   "gate_ffn", "gate"):
            p.copy_(torch.randn(p.shape, generator=gen))


def zero_text_rows(model) -> list:
    """Make a transformers Mllama model zero the cross-attention output of rows that attend to
    no image, as Meta's model and vLLM do (transformers 5.24 zeroes only those rows' MLP output
    and lets their attention spread over every tile). The hooks multiply each cross-attention
    layer's attention output by the row mask transformers itself passes the layer
    (`full_text_row_masked_out_mask`, 0 for such rows), nothing else. Returns the hook handles
    (`.remove()` undoes it)."""
    from transformers.models.mllama.modeling_mllama import MllamaCrossAttentionDecoderLayer

    handles = []
    for layer in model.modules():
        if not isinstance(layer, MllamaCrossAttentionDecoderLayer):
            continue
        seen: dict[str, torch.Tensor | None] = {}

        def remember(_module, _args, kwargs, seen=seen):
            seen["rows"] = kwargs.get("full_text_row_masked_out_mask")

        def zero(_module, _args, output, seen=seen):
            rows = seen.get("rows")
            if rows is None:
                return output
            return (output[0] * rows[:, 0], *output[1:])  # rows [B, 1, S, 1] -> [B, S, 1]

        handles.append(layer.register_forward_pre_hook(remember, with_kwargs=True))
        handles.append(layer.cross_attn.register_forward_hook(zero))
    return handles
