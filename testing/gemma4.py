"""Tiny random-weight Gemma 4 checkpoints: Gemma4ForConditionalGeneration (vision tower, audio
encoder, a decoder with per-layer inputs, KV shared across its last layers, global layers with
their own head size, proportional RoPE) or a mixture-of-experts one, with a locally trained
tokenizer holding Gemma 4's turn and media tokens, a Gemma-4-shaped chat template, and the
processor's settings (Gemma4Processor cannot be built here: its video processor needs
torchvision) in transformers 5's layout.

`config_layout="hub"` rewrites config.json as the Hub's checkpoints hold it (`global_head_dim`
and `num_global_key_value_heads` where transformers 5.24 saves `per_layer_config`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from testing.layouts import save_processor
from testing.tiny import randomize, save_checkpoint, train_tokenizer

GEMMA4_SPECIAL = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|image>", "<image|>",
                  "<|image|>", "<|audio>", "<audio|>", "<|audio|>", "<|video|>"]
# The names Gemma4Processor reads its tokens by (the tokenizer's extra special tokens).
GEMMA4_TOKEN_NAMES = {
    "boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
    "boa_token": "<|audio>", "eoa_token": "<audio|>", "audio_token": "<|audio|>",
}
GEMMA4_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<|turn>{{ role }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|image|>"
    "{% elif part['type'] == 'video' %}<|video|>"
    "{% elif part['type'] == 'audio' %}<|audio|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention",
               "sliding_attention", "sliding_attention", "full_attention"]
# The processor's settings away from their class defaults where the tiny tower needs it.
PATCH_SIZE = 4
MEL_BINS = 32


def gemma4_tokenizer(vocab_size: int = 600, kind: str = "bytes",
                     added_special: tuple[str, ...] = ()):
    """A tokenizer (`train_tokenizer`'s `kind`) with Gemma 4's special tokens, named as its
    processor reads them (`tokenizer.boi_token`, ...), and `added_special` after them."""
    from transformers import PreTrainedTokenizerFast

    trained = train_tokenizer([*GEMMA4_SPECIAL, *added_special], vocab_size,
                              GEMMA4_CHAT_TEMPLATE, "<turn|>", kind)
    extra = {"unk_token": trained.unk_token} if trained.unk_token else {}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=trained.backend_tokenizer, eos_token="<turn|>", pad_token="<pad>",
        bos_token="<bos>", extra_special_tokens=GEMMA4_TOKEN_NAMES, **extra)
    tok.chat_template = GEMMA4_CHAT_TEMPLATE
    return tok


def text_config(tokenizer, *, experts: bool = False, hidden_size: int = 64, **overrides):
    """A Gemma4TextConfig: 6 layers (4 sliding, 2 global with a 32-wide head and one KV head).
    E-size (default): per-layer inputs, the last two layers reading the KV of layers 3 and 2
    with double-wide MLPs. `experts`: the 26B-A4B shape instead (experts beside the dense MLP,
    values that are the keys on global layers, no KV sharing or per-layer inputs)."""
    import transformers

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GEMMA4_SPECIAL}
    options = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        global_head_dim=32, num_global_key_value_heads=1, layer_types=list(LAYER_TYPES),
        sliding_window=12, max_position_embeddings=2048, final_logit_softcapping=30.0,
        pad_token_id=ids["<pad>"], eos_token_id=ids["<eos>"], bos_token_id=ids["<bos>"],
        use_bidirectional_attention="vision",
    )
    if experts:
        options.update(attention_k_eq_v=True, enable_moe_block=True, num_experts=4,
                       top_k_experts=2, moe_intermediate_size=32,
                       hidden_size_per_layer_input=0, num_kv_shared_layers=0)
    else:
        options.update(hidden_size_per_layer_input=8, vocab_size_per_layer_input=len(tokenizer),
                       num_kv_shared_layers=2, use_double_wide_mlp=True)
    options.update(overrides)
    return transformers.Gemma4TextConfig(**options)


def build_gemma4_model(
    path: Path,
    *,
    experts: bool = False,
    vision: bool = True,
    audio: bool = True,
    text_only: bool = False,
    tie_word_embeddings: bool | None = None,
    config_layout: str = "transformers5",
    seed: int = 0,
    std: float = 0.25,
    image_soft_tokens: int = 70,
    video_soft_tokens: int = 70,
    num_frames: int = 4,
    tokenizer_kind: str = "bytes",
    added_special: tuple[str, ...] = (),
    **text_overrides,
) -> Path:
    """A tiny Gemma 4 at `path` (see the module docstring); `text_only` saves
    Gemma4ForCausalLM (no towers, no processor); `tokenizer_kind` as `train_tokenizer`'s;
    `added_special`: more special tokens (testing.chat_formats.GEMMA4_TOOL_TOKENS)."""
    import transformers

    tokenizer = gemma4_tokenizer(kind=tokenizer_kind, added_special=tuple(added_special))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in GEMMA4_SPECIAL}
    text = text_config(tokenizer, experts=experts, **text_overrides)
    if text_only:
        if tie_word_embeddings is not None:
            text.tie_word_embeddings = tie_word_embeddings
        torch.manual_seed(seed)
        model = transformers.Gemma4ForCausalLM(text)
    else:
        vision_cfg = transformers.Gemma4VisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, head_dim=8, patch_size=PATCH_SIZE, pooling_kernel_size=3,
            position_embedding_size=128, standardize=True, use_clipped_linears=True,
        ) if vision else None
        audio_cfg = transformers.Gemma4AudioConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            subsampling_conv_channels=[MEL_BINS, 8], conv_kernel_size=5, output_proj_dims=48,
        ) if audio else None
        config = transformers.Gemma4Config(
            text_config=text, vision_config=vision_cfg, audio_config=audio_cfg,
            boi_token_id=ids["<|image>"], eoi_token_id=ids["<image|>"],
            image_token_id=ids["<|image|>"], video_token_id=ids["<|video|>"],
            boa_token_id=ids["<|audio>"], eoa_token_index=ids["<audio|>"],
            audio_token_id=ids["<|audio|>"],
        )
        if tie_word_embeddings is not None:  # the flag transformers ties the head by
            config.tie_word_embeddings = tie_word_embeddings
        torch.manual_seed(seed)
        model = transformers.Gemma4ForConditionalGeneration(config)
    randomize(model, std=std, seed=seed)
    _randomize_buffers(model, seed)
    eos = [ids["<turn|>"], ids["<eos>"]]
    if "<|tool_response>" in added_special:  # a turn that calls ends there, as Gemma 4's does
        eos.append(tokenizer.convert_tokens_to_ids("<|tool_response>"))
    path = save_checkpoint(model, tokenizer, Path(path), eos)
    if not text_only:
        save_gemma4_processor(path, tokenizer, image_soft_tokens=image_soft_tokens,
                              video_soft_tokens=video_soft_tokens, num_frames=num_frames)
    if config_layout == "hub":
        to_hub_config(path)
    return path


@torch.no_grad()
def _randomize_buffers(model, seed: int) -> None:
    """The persistent buffers a real checkpoint holds away from their initial values: layer
    scalars, the vision output's standardization, the clipped linears' bounds (finite, so that
    they clip), and the router's scales (randomize leaves 1-D parameters near 0)."""
    gen = torch.Generator().manual_seed(seed + 1)

    def draw(t: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(t.shape, generator=gen)

    for name, buffer in model.named_buffers():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "layer_scalar":
            buffer.copy_(draw(buffer, 0.5, 1.5))
        elif leaf == "std_bias":
            buffer.copy_(draw(buffer, -0.2, 0.2))
        elif leaf == "std_scale":
            buffer.copy_(draw(buffer, 0.8, 1.2))
        elif leaf in ("input_min", "output_min"):
            buffer.fill_(-float(draw(buffer, 1.0, 3.0)))
        elif leaf in ("input_max", "output_max"):
            buffer.fill_(float(draw(buffer, 1.0, 3.0)))
    for name, param in model.named_parameters():
        if name.endswith(("router.scale", "router.per_expert_scale")):
            param.copy_(draw(param, 0.5, 1.5))


def save_gemma4_processor(path: Path, tokenizer, *, image_soft_tokens: int = 70,
                          video_soft_tokens: int = 70, num_frames: int = 4) -> Path:
    """processor_config.json as transformers 5's Gemma4Processor.save_pretrained writes it:
    the image processor's and feature extractor's own to_dict(), the video processor's
    settings (its class needs torchvision), the processor's fields."""
    import transformers

    image = transformers.Gemma4ImageProcessorPil(patch_size=PATCH_SIZE,
                                                 max_soft_tokens=image_soft_tokens)
    features = transformers.Gemma4AudioFeatureExtractor(feature_size=MEL_BINS)
    feature_dict = json.loads(features.to_json_string())
    # Every setting the class's to_dict() writes (its own and the base class's).
    video = {"video_processor_type": "Gemma4VideoProcessor", "patch_size": PATCH_SIZE,
             "max_soft_tokens": video_soft_tokens, "pooling_kernel_size": 3,
             "num_frames": num_frames, "do_sample_frames": True, "do_resize": True,
             "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
             "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0], "resample": 3,
             "do_convert_rgb": True, "size": None, "default_to_square": True, "fps": None,
             "crop_size": None, "do_center_crop": None, "do_pad": None,
             "video_metadata": None, "return_metadata": False, "data_format": "channels_first",
             "input_data_format": None, "device": None}
    return save_processor(path, "Gemma4Processor", tokenizer, image_processor=image,
                          video_settings=video, components={"feature_extractor": feature_dict},
                          fields={"image_seq_length": image_soft_tokens,
                                  "audio_seq_length": 750, "audio_ms_per_token": 40})


def to_hub_config(path: Path) -> Path:
    """config.json as the Hub's Gemma 4 checkpoints write it: the global layers' head size and
    KV heads as `global_head_dim` / `num_global_key_value_heads`, no `per_layer_config`."""
    file = Path(path) / "config.json"
    config = json.loads(file.read_text())
    text = config.get("text_config", config)
    overrides = text.pop("per_layer_config", {}) or {}
    values = {k: v for layer in overrides.values() for k, v in layer.items()}
    if set(values) - {"head_dim", "num_key_value_heads"}:
        raise ValueError(f"per_layer_config holds {sorted(values)}: not expressible the Hub's way")
    text["global_head_dim"] = values.get("head_dim", text["head_dim"])
    if "num_key_value_heads" in values:
        text["num_global_key_value_heads"] = values["num_key_value_heads"]
    file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return path


def hf_inputs(hf_config, proc) -> dict:
    """transformers' Gemma4ForConditionalGeneration inputs for the engine's processed prompt
    (its processor cannot be built here): the token ids, `mm_token_type_ids` (1 image, 2 video,
    3 audio: the bidirectional image mask reads them), and each modality's items padded into
    the reference's batch layout (patches with (-1, -1) positions, frames with a mask)."""
    ids = torch.tensor([proc.token_ids])
    kinds = ((hf_config.image_token_id, 1), (hf_config.video_token_id, 2),
             (hf_config.audio_token_id, 3))
    types = sum(kind * (ids == token).long() for token, kind in kinds)
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": types}
    for modality, pixels, positions in (("image", "pixel_values", "image_position_ids"),
                                        ("video", "pixel_values_videos", "video_position_ids")):
        items = [f.data for f in proc.mm_features if f.modality == modality]
        if items:
            out[pixels], out[positions] = _pad(items, "pixel_values", "positions", -1)
    frames = [f.item for f in proc.mm_features if f.modality == "video"]
    if frames:
        out["num_frames_per_video"] = torch.tensor([frames.count(v) for v in
                                                    dict.fromkeys(frames)])
    clips = [f.data for f in proc.mm_features if f.modality == "audio"]
    if clips:
        out["input_features"], out["input_features_mask"] = _pad(clips, "input_features",
                                                                 "mask", False)
    return out


def _pad(items: list[dict], values: str, marks: str, fill) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(d[values].shape[0] for d in items)
    first = items[0]
    v = torch.zeros(len(items), longest, *first[values].shape[1:], dtype=first[values].dtype)
    m = torch.full((len(items), longest, *first[marks].shape[1:]), fill,
                   dtype=first[marks].dtype)
    for i, d in enumerate(items):
        n = d[values].shape[0]
        v[i, :n], m[i, :n] = d[values], d[marks]
    return v, m


def build_gemma4_assistant(path: Path, target: Path, *, ordered: bool = False,
                           centroids: int | None = None, top_centroids: int | None = None,
                           hidden_size: int = 32, seed: int = 1, std: float = 0.25,
                           **text_overrides) -> Path:
    """A tiny random Gemma4AssistantForCausalLM (no tokenizer, as the drafter's repos ship)
    for the text-only target at `target` (build_gemma4_model's, `text_only=True`): 2 layers,
    a sliding and a global one, whose attention shapes are the target's; `ordered`: with
    `use_ordered_embeddings` (`centroids` over a random token ordering, the `top_centroids`
    scored; by default centroids of about 20 tokens, a quarter of them scored);
    `text_overrides`: its text config's settings."""
    import transformers

    target_text = transformers.AutoConfig.from_pretrained(target).get_text_config()
    vocab = target_text.vocab_size
    options = dict(
        vocab_size=vocab, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        global_head_dim=32, num_global_key_value_heads=1,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=target_text.sliding_window, max_position_embeddings=2048,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        pad_token_id=target_text.pad_token_id, eos_token_id=target_text.eos_token_id,
        bos_token_id=target_text.bos_token_id)
    options.update(text_overrides)
    options["num_kv_shared_layers"] = options["num_hidden_layers"]  # all read the target's
    text = transformers.Gemma4TextConfig(**options)
    if centroids is None:  # a divisor of the vocabulary: centroids of about 20 tokens
        centroids = next(c for c in range(vocab // 20, vocab + 1) if vocab % c == 0)
    config = transformers.Gemma4AssistantConfig(
        text_config=text, backbone_hidden_size=target_text.hidden_size,
        use_ordered_embeddings=ordered, num_centroids=centroids,
        centroid_intermediate_top_k=top_centroids or max(2, centroids // 4),
        architectures=["Gemma4AssistantForCausalLM"])
    torch.manual_seed(seed)
    model = transformers.Gemma4AssistantForCausalLM(config)
    randomize(model, std=std, seed=seed)
    if ordered:
        gen = torch.Generator().manual_seed(seed)
        model.masked_embedding.token_ordering.copy_(torch.randperm(vocab, generator=gen))
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path


@torch.no_grad()
def assistant_reference(target, assistant, tokens: list[int], drafts: int
                        ) -> tuple[list[torch.Tensor], list[int]]:
    """transformers' greedy drafts after `tokens` (the newest last, not yet computed by the
    target): the target (a Gemma4ForCausalLM) over the tokens before the newest returns its
    shared keys and values and its final hidden state, then the assistant (a
    Gemma4AssistantForCausalLM) drafts as transformers' multi-token candidate generator does
    (the newest token's embedding beside that hidden state, at the newest token's position).
    Returns each draft's logits [V] and the drafts."""
    out = target(torch.tensor([tokens[:-1]]), output_hidden_states=True,
                 return_shared_kv_states=True, use_cache=True)
    shared = out.shared_kv_states
    hidden = out.hidden_states[-1][:, -1:]
    last = torch.tensor([[tokens[-1]]])
    position = torch.tensor([[len(tokens) - 1]])
    mask = torch.ones(1, len(tokens), dtype=torch.long)
    embed = target.get_input_embeddings()
    logits, picked = [], []
    for _ in range(drafts):
        step = assistant(inputs_embeds=torch.cat([embed(last), hidden], dim=-1),
                         attention_mask=mask, position_ids=position, shared_kv_states=shared)
        logits.append(step.logits[0, -1])
        last, hidden = step.logits.argmax(-1), step.last_hidden_state
        picked.append(int(last))
    return logits, picked
