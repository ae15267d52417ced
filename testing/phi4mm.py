"""Tiny random-weight Phi-4-multimodal checkpoints: Phi4MultimodalForCausalLM (a SigLIP tower on
dynamic-HD crops, a conformer audio encoder, a Phi-3 style decoder with partial rotary and
longrope), a tokenizer with Phi's turn tokens and `<|image|>` / `<|audio|>`, its chat template,
and the Hub's two PEFT adapter folders beside the weights: `vision-lora` and `speech-lora`
(written in PEFT's format without PEFT: testing/lora.py).

The crops keep Phi-4-MM's real geometry by default (448-pixel crops of 14-pixel patches), on a
narrow two-layer tower, with at most `dynamic_hd` crops per image; `crop` and `patch` choose
another geometry of 32 x 32 patches per crop (transformers' processor counts an image's tokens
for that patch grid only), e.g. 128-pixel crops of 4-pixel patches. transformers' image
processor needs torchvision, so its settings are written as its `to_dict()` writes them (the
feature extractor is saved by transformers itself).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from testing.layouts import save_processor
from testing.lora import write_lora_folder
from testing.tiny import randomize, save_checkpoint, train_tokenizer

PHI_SPECIAL = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>",
               "<|image|>", "<|audio|>"]
PHI4MM_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>"
    "{% elif part['type'] == 'audio' %}<|audio|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# The decoder's linears the Hub's adapters target (the audio encoder has modules of the same
# names, which they leave alone).
LORA_TARGETS = r"model\.layers\.\d+\.(self_attn\.(qkv|o)_proj|mlp\.(gate_up|down)_proj)"
ADAPTERS = {"vision-lora": {"r": 8, "lora_alpha": 16, "seed": 11},
            "speech-lora": {"r": 6, "lora_alpha": 12, "seed": 12}}


def phi4mm_tokenizer(vocab_size: int = 600, kind: str = "bytes",
                     added_special: tuple[str, ...] = ()):
    from transformers import PreTrainedTokenizerFast

    tok = train_tokenizer([*PHI_SPECIAL, *added_special], vocab_size, PHI4MM_CHAT_TEMPLATE,
                          "<|end|>", kind)
    extra = {"unk_token": tok.unk_token} if tok.unk_token else {}
    phi = PreTrainedTokenizerFast(
        tokenizer_object=tok.backend_tokenizer, eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<|image|>", "audio_token": "<|audio|>"}, **extra)
    phi.chat_template = PHI4MM_CHAT_TEMPLATE
    return phi


def image_processor_settings(dynamic_hd: int, crop: int = 448, patch: int = 14) -> dict:
    """What Phi4MultimodalImageProcessor's `to_dict()` writes (its class settings, but `crop`
    and `patch`)."""
    return {
        "do_convert_rgb": True, "resample": 3, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "size": {"height": crop, "width": crop},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "patch_size": patch,
        "dynamic_hd": dynamic_hd, "image_processor_type": "Phi4MultimodalImageProcessor",
    }


def build_phi4mm_model(
    path: Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    vision_width: int = 32,
    audio_width: int = 32,
    dynamic_hd: int = 4,
    crop: int = 448,
    patch: int = 14,
    seed: int = 0,
    std: float = 0.25,
    tokenizer_kind: str = "bytes",
    tie_word_embeddings: bool | None = None,
    adapters: bool = True,
    added_special: tuple[str, ...] = (),
) -> Path:
    """A tiny Phi4MultimodalForCausalLM at `path`, with its processor settings and (unless
    `adapters` is False) random vision-lora and speech-lora adapters beside it;
    `added_special`: more special tokens (testing.chat_formats.PHI4_TOOL_TOKENS)."""
    import transformers

    tokenizer = phi4mm_tokenizer(kind=tokenizer_kind, added_special=tuple(added_special))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in PHI_SPECIAL}
    heads, head_dim = 4, 16
    rotary = head_dim * 3 // 4  # partial_rotary_factor 0.75, as Phi-4-mini
    gen = torch.Generator().manual_seed(seed + 1)
    factors = (1.0 + 2.0 * torch.rand(2, rotary // 2, generator=gen)).tolist()
    vision = dict(hidden_size=vision_width, intermediate_size=2 * vision_width,
                  num_hidden_layers=2, num_attention_heads=4, image_size=crop, patch_size=patch,
                  crop_size=crop, image_token_id=ids["<|image|>"], feature_layer=-2)
    audio = dict(hidden_size=audio_width, intermediate_size=2 * audio_width, num_blocks=2,
                 num_attention_heads=4, ext_pw_out_channel=audio_width,
                 depthwise_separable_out_channel=audio_width, nemo_conv_channels=16,
                 bias_max_distance=12, audio_token_id=ids["<|audio|>"], feature_layer=-2)
    config = transformers.Phi4MultimodalConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=2,
        max_position_embeddings=8192, original_max_position_embeddings=2048,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.75, "short_factor": factors[0],
                         "long_factor": factors[1]},
        bos_token_id=ids["<|endoftext|>"], eos_token_id=[ids["<|endoftext|>"], ids["<|end|>"]],
        pad_token_id=ids["<|endoftext|>"], vision_config=vision, audio_config=audio,
        tie_word_embeddings=bool(tie_word_embeddings),
    )
    torch.manual_seed(seed)
    model = transformers.Phi4MultimodalForCausalLM(config)
    randomize(model, std=std, seed=seed)
    _calibrate(model, seed)
    path = save_checkpoint(model, tokenizer, Path(path), [ids["<|endoftext|>"], ids["<|end|>"]])
    extractor = transformers.Phi4MultimodalFeatureExtractor()
    save_processor(path, "Phi4MultimodalProcessor", tokenizer,
                   components={"image_processor": image_processor_settings(dynamic_hd, crop, patch),
                               "audio_processor": extractor.to_dict()})
    if adapters:
        shapes = {name: (m.in_features, m.out_features) for name, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and re.fullmatch(LORA_TARGETS, name)}
        for folder, options in ADAPTERS.items():
            write_lora_folder(path / folder, shapes, LORA_TARGETS, std=0.4, **options)
    return path


@torch.no_grad()
def _calibrate(model, seed: int) -> None:
    """Scales `randomize` cannot know: the audio encoder's input normalisation (log-mel values
    are around 10, not 0) and its layer norms' offsets, and the media projections' size so that
    media embeddings weigh like token embeddings."""
    audio = model.model.embed_tokens_extend.audio_embed.encoder
    gen = torch.Generator().manual_seed(seed + 2)
    audio.encoder_embedding.global_mean.copy_(10.0 + torch.randn(
        audio.encoder_embedding.global_mean.shape, generator=gen))
    audio.encoder_embedding.global_invstd.copy_(0.3 + 0.05 * torch.rand(
        audio.encoder_embedding.global_invstd.shape, generator=gen))
    for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.weight.copy_(1.0 + 0.1 * torch.randn(module.weight.shape, generator=gen))
