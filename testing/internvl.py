"""Tiny random-weight InternVL (InternVLForConditionalGeneration) checkpoints: an InternViT tower
on 32-pixel tiles of 4-pixel patches (16 tokens a tile after the pixel shuffle), a Qwen2, Qwen3,
Qwen3-MoE or Llama decoder, a tokenizer with InternVL's media tokens (`<img>`, `</img>`,
`<IMG_CONTEXT>`, `<video>`, named in its config as transformers' converted checkpoints name them)
and the chat template of the converted checkpoints, the GotOcr2 image processor's and the
InternVL video processor's settings.

`reference_processor` is transformers' own InternVLProcessor for images (its video processor
needs torchvision, absent here, so the processor is assembled without it), and
`reference_video_text` the text it writes for a video.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import torch

from testing.tiny import randomize, save_checkpoint, train_tokenizer

INTERNVL_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>",
                    "<IMG_CONTEXT>", "<video>"]
MEDIA_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>",
                "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
# The template transformers' conversion script gives the converted checkpoints.
INTERNVL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\n' }}{% endif %}"
)
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]
TILE = 32
PATCH = 4
TOKENS_PER_TILE = (TILE // PATCH // 2) ** 2
TEXT_CONFIGS = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "llama": "LlamaConfig",
                "qwen3_moe": "Qwen3MoeConfig"}
# InternVL3.5's mixtures of experts, tiny: 4 experts, 2 routed per token.
TINY_EXPERTS = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                "norm_topk_prob": True}


@functools.cache
def internvl_tokenizer(vocab_size: int = 600, kind: str = "bytes"):
    """A trained tokenizer whose config names InternVL's media tokens (trained once per
    process: every checkpoint built here shares it, unchanged)."""
    from transformers import PreTrainedTokenizerFast

    trained = train_tokenizer(INTERNVL_SPECIAL, vocab_size, INTERNVL_CHAT_TEMPLATE, "<|im_end|>",
                              kind)
    extra = {"unk_token": trained.unk_token} if kind == "words" else {}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=trained.backend_tokenizer, eos_token="<|im_end|>",
        pad_token="<|endoftext|>", extra_special_tokens=MEDIA_TOKENS, **extra)
    tokenizer.chat_template = INTERNVL_CHAT_TEMPLATE
    return tokenizer


def build_internvl_model(
    path: Path,
    *,
    text: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
    vision_width: int = 32,
    vision_depth: int = 2,
    vision_heads: int = 4,
    vision_intermediate: int | None = None,
    tile: int = TILE,
    patch: int = PATCH,
    qk_norm: bool = False,
    norm_type: str = "layer_norm",
    attention_bias: bool = True,
    mean_pooling: bool = True,
    vision_feature_layer: int = -1,
    min_patches: int = 1,
    max_patches: int = 6,
    num_frames: int | None = None,
    seed: int = 0,
    std: float = 0.25,
    tokenizer_kind: str = "bytes",
    tie_word_embeddings: bool | None = None,
) -> Path:
    """A tiny InternVLForConditionalGeneration at `path` with a `text` decoder (qwen2, qwen3,
    qwen3_moe, llama) and the tower's variants as options (the widths too, for the
    benchmarks); images are cut into at most `max_patches` tiles of `tile` pixels; with
    `num_frames`, the video processor samples that many frames (do_sample_frames), else it
    takes every frame it is given (its class default)."""
    import transformers

    from testing.layouts import save_processor

    tokenizer = internvl_tokenizer(kind=tokenizer_kind)
    text_cfg = getattr(transformers, TEXT_CONFIGS[text])(
        hidden_size=hidden_size, intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        vocab_size=vocab_size or len(tokenizer), max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
        **({"head_dim": hidden_size // heads} if text.startswith("qwen3") else {}),
        **(TINY_EXPERTS if text == "qwen3_moe" else {}))
    vision = transformers.InternVLVisionConfig(
        hidden_size=vision_width, intermediate_size=vision_intermediate or 2 * vision_width,
        num_hidden_layers=vision_depth, num_attention_heads=vision_heads, image_size=tile,
        patch_size=patch, use_qk_norm=qk_norm, norm_type=norm_type,
        attention_bias=attention_bias, use_mean_pooling=mean_pooling)
    per_tile = (tile // patch // 2) ** 2
    config = transformers.InternVLConfig(
        text_config=text_cfg, vision_config=vision, image_seq_length=per_tile,
        image_token_id=tokenizer.convert_tokens_to_ids("<IMG_CONTEXT>"),
        vision_feature_layer=vision_feature_layer)
    if tie_word_embeddings is not None:  # the flag transformers ties the head by
        config.tie_word_embeddings = tie_word_embeddings
    torch.manual_seed(seed)
    model = transformers.InternVLForConditionalGeneration(config)
    randomize(model, std=std, seed=seed)
    path = save_checkpoint(model, tokenizer, Path(path), [tokenizer.eos_token_id])
    size = {"height": tile, "width": tile}
    image = transformers.GotOcr2ImageProcessorPil(
        size=size, min_patches=min_patches, max_patches=max_patches, image_mean=IMAGENET_MEAN,
        image_std=IMAGENET_STD)
    # InternVLVideoProcessor needs torchvision: its settings as its to_dict() writes them.
    video = {"do_convert_rgb": True, "do_resize": True, "size": size, "default_to_square": True,
             "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
             "do_normalize": True, "image_mean": IMAGENET_MEAN, "image_std": IMAGENET_STD,
             "do_center_crop": None, "do_pad": None, "crop_size": None,
             "do_sample_frames": num_frames is not None, "fps": None, "num_frames": num_frames,
             "initial_shift": True, "return_metadata": False,
             "video_processor_type": "InternVLVideoProcessor"}
    save_processor(path, "InternVLProcessor", tokenizer, image_processor=image,
                   video_settings=video, fields={"image_seq_length": per_tile})
    # Name the PIL class: the reference here (no torchvision) resizes with PIL, and a checkpoint
    # naming GotOcr2ImageProcessor gets transformers' default torchvision resizing.
    config = json.loads((path / "processor_config.json").read_text())
    config["image_processor"]["image_processor_type"] = "GotOcr2ImageProcessorPil"
    (path / "processor_config.json").write_text(json.dumps(config, indent=2))
    return path


def rename_to_transformers5_keys(path: Path) -> Path:
    """Rewrite the weights' names into the layout transformers 5's class holds them in
    (model.language_model.*, lm_head.*, model.vision_tower.*, model.multi_modal_projector.*),
    which some converted checkpoints carry; save_pretrained writes the Hub's older names."""
    from safetensors.torch import load_file, save_file

    file = Path(path) / "model.safetensors"
    renames = (("language_model.model.", "model.language_model."),
               ("language_model.lm_head.", "lm_head."), ("vision_tower.", "model.vision_tower."),
               ("multi_modal_projector.", "model.multi_modal_projector."))
    tensors = {}
    for name, tensor in load_file(file).items():
        for old, new in renames:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        tensors[name] = tensor
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def reference_processor(path: Path):
    """transformers' InternVLProcessor over the checkpoint's image processor and tokenizer (its
    fields read from processor_config.json), without the video processor it cannot build here."""
    import json

    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    fields = json.loads((Path(path) / "processor_config.json").read_text())
    proc = transformers.InternVLProcessor.__new__(transformers.InternVLProcessor)
    proc.image_processor = transformers.AutoImageProcessor.from_pretrained(path)
    proc.tokenizer = tokenizer
    proc.chat_template = tokenizer.chat_template
    # What InternVLProcessor.__init__ sets once its components are checked.
    proc.image_seq_length = fields.get("image_seq_length", 256)
    proc.start_image_token, proc.end_image_token = (tokenizer.start_image_token,
                                                    tokenizer.end_image_token)
    proc.start_image_token_id = tokenizer.start_image_token_id
    proc.end_image_token_id = tokenizer.end_image_token_id
    proc.image_token, proc.video_token = tokenizer.context_image_token, tokenizer.video_token
    proc.image_token_id = tokenizer.context_image_token_id
    proc.multimodal_pattern = re.compile(
        f"(?P<image>{re.escape(proc.image_token)})|(?P<video>{re.escape(proc.video_token)})")
    return proc


def reference_video_text(proc, frames: int) -> str:
    """InternVLProcessor's text for a video of `frames` frames."""
    import transformers

    return transformers.InternVLProcessor.replace_video_token(
        proc, {"pixel_values_videos": [torch.zeros(frames)]}, 0)
