"""Tiny random-weight Qwen3.5 checkpoints: Qwen3_5ForConditionalGeneration (a hybrid decoder of
Gated DeltaNet and gated-attention layers with partial interleaved mRoPE; Qwen3-VL's 16-px tower
without DeepStack) with Qwen3-VL's processor settings, and the text-only Qwen3_5ForCausalLM, in
transformers 5's layout; with `experts`, Qwen3.5-MoE's classes (every layer's feed-forward block
a mixture of experts with a gated shared expert)."""

from __future__ import annotations

from pathlib import Path

import torch

from testing.qwen3_vl import save_qwen3_vl_processor
from testing.tiny import QWEN_SPECIAL, qwen_tokenizer, randomize, save_checkpoint

# Two linear-attention layers, a full-attention one, and a linear one after it.
LAYER_TYPES = ("linear_attention", "linear_attention", "full_attention", "linear_attention")


def text_config(tokenizer, special: dict[str, int], hidden_size: int,
                layer_types: tuple[str, ...], experts: dict | None = None) -> dict:
    """The text settings both builders share: 4 attention heads of 32 (RoPE on 8 of them, in
    interleaved sections 2, 1, 1), linear attention with 2 key heads and 4 value heads of 16;
    `experts` replace the dense MLP's size (Qwen3.5-MoE has no dense layers)."""
    mlp = {"intermediate_size": 2 * hidden_size} if experts is None else experts
    return dict(
        hidden_size=hidden_size, **mlp,
        num_hidden_layers=len(layer_types), layer_types=list(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4,
        vocab_size=len(tokenizer), max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1],
                         "mrope_interleaved": True, "partial_rotary_factor": 0.25},
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        pad_token_id=special["<|endoftext|>"],
    )


def build_qwen3_5_model(
    path: Path,
    *,
    hidden_size: int = 64,
    layer_types: tuple[str, ...] = LAYER_TYPES,
    vision_width: int = 32,
    vision_depth: int = 2,
    max_image_tokens: int = 64,
    seed: int = 0,
    std: float = 0.25,
    tie_word_embeddings: bool | None = None,
    experts: dict | None = None,
    tokenizer=None,
    **save_kwargs,
) -> Path:
    """A tiny Qwen3_5ForConditionalGeneration at `path` (with `experts`, text config fields
    such as num_experts, num_experts_per_tok, moe_intermediate_size,
    shared_expert_intermediate_size: a Qwen3_5MoeForConditionalGeneration); `tokenizer`
    (default: the tiny Qwen one) carries the chat template; `save_kwargs` go to
    save_pretrained."""
    import transformers

    tokenizer = tokenizer or qwen_tokenizer()
    special = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    vision = dict(depth=vision_depth, hidden_size=vision_width, intermediate_size=2 * vision_width,
                  num_heads=4, out_hidden_size=hidden_size, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=16)
    kind = "Qwen3_5" if experts is None else "Qwen3_5Moe"
    config = getattr(transformers, kind + "Config")(
        text_config=text_config(tokenizer, special, hidden_size, layer_types, experts),
        vision_config=vision, image_token_id=special["<|image_pad|>"],
        video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"],
        vision_end_token_id=special["<|vision_end|>"],
    )
    if tie_word_embeddings is not None:
        config.tie_word_embeddings = tie_word_embeddings
    torch.manual_seed(seed)
    model = getattr(transformers, kind + "ForConditionalGeneration")(config)
    randomize(model, std=std, seed=seed)
    path = save_checkpoint(model, tokenizer, Path(path), [tokenizer.eos_token_id],
                           **save_kwargs)
    return save_qwen3_vl_processor(path, tokenizer, max_image_tokens)


def build_qwen3_5_text_model(
    path: Path,
    *,
    hidden_size: int = 64,
    layer_types: tuple[str, ...] = LAYER_TYPES,
    seed: int = 0,
    std: float = 0.25,
    tie_word_embeddings: bool = False,
) -> Path:
    """A tiny text-only Qwen3_5ForCausalLM at `path`."""
    import transformers

    tokenizer = qwen_tokenizer()
    special = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    config = transformers.Qwen3_5TextConfig(
        **text_config(tokenizer, special, hidden_size, layer_types),
        tie_word_embeddings=tie_word_embeddings)
    torch.manual_seed(seed)
    model = transformers.Qwen3_5ForCausalLM(config)
    randomize(model, std=std, seed=seed)
    return save_checkpoint(model, tokenizer, Path(path), [tokenizer.eos_token_id])


def add_mtp_weights(path: Path, *, seed: int = 7, std: float = 0.25) -> Path:
    """Give the checkpoint at `path` one multi-token-prediction layer, as Qwen3.5's real
    checkpoints carry it (vLLM's Qwen3_5MultiTokenPredictor names): `mtp_num_hidden_layers` 1
    in its text config and random `mtp.*` tensors (fc, the two pre-fc norms, a full-attention
    decoder layer of the target's shape, built by transformers' own Qwen3.5 layer class, and
    the final norm) in a second weight file, with an index naming every tensor's file."""
    import json

    import transformers
    from safetensors.torch import save_file

    from models.checkpoint import safetensors_header

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    text["mtp_num_hidden_layers"] = 1
    text["mtp_use_dedicated_embeddings"] = False
    (path / "config.json").write_text(json.dumps(config, indent=2))
    hf = transformers.AutoConfig.from_pretrained(path).get_text_config()
    full = hf.layer_types.index("full_attention")
    moe = bool(getattr(hf, "num_experts", 0))
    kind, name = ("Qwen3_5Moe", "qwen3_5_moe") if moe else ("Qwen3_5", "qwen3_5")
    modeling = getattr(getattr(transformers.models, name), f"modeling_{name}")
    layer_cls = getattr(modeling, f"{kind}DecoderLayer")
    norm_cls = getattr(modeling, f"{kind}RMSNorm")
    torch.manual_seed(seed)
    mtp = torch.nn.Module()
    mtp.layers = torch.nn.ModuleList([layer_cls(hf, full)])
    mtp.fc = torch.nn.Linear(2 * hf.hidden_size, hf.hidden_size, bias=False)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        setattr(mtp, name, norm_cls(hf.hidden_size, eps=hf.rms_norm_eps))
    randomize(mtp, std=std, seed=seed)
    tensors = {f"mtp.{k}": v.contiguous() for k, v in mtp.state_dict().items()}
    save_file(tensors, path / "model-mtp.safetensors", metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {}}
    for file in ("model.safetensors", "model-mtp.safetensors"):
        for name in safetensors_header(path / file):
            if name != "__metadata__":
                index["weight_map"][name] = file
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return path


@torch.no_grad()
def mtp_reference(path: Path, ids: list[int], drafts: int = 2) -> tuple[torch.Tensor, list[int]]:
    """The MTP layer of a text checkpoint with add_mtp_weights, assembled from transformers'
    own Qwen3.5 modules as vLLM's Qwen3_5MultiTokenPredictor defines it, after the prompt+token
    `ids`: (the first draft's logits [V], the greedy drafts, `drafts` of them: each further
    draft from the layer's own output and the draft before it, one position on)."""
    import transformers
    from safetensors.torch import load_file

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    text = hf.config.get_text_config()
    full = text.layer_types.index("full_attention")
    module = transformers.models.qwen3_5.modeling_qwen3_5
    mtp = torch.nn.Module()
    mtp.layers = torch.nn.ModuleList([module.Qwen3_5DecoderLayer(text, full)])
    mtp.fc = torch.nn.Linear(2 * text.hidden_size, text.hidden_size, bias=False)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        setattr(mtp, name, module.Qwen3_5RMSNorm(text.hidden_size, eps=text.rms_norm_eps))
    weights = {k[len("mtp."):]: v for k, v in load_file(path / "model-mtp.safetensors").items()}
    mtp.load_state_dict(weights)
    mtp.eval()
    tokens = torch.tensor([ids])
    hidden = hf(tokens, output_hidden_states=True).hidden_states[-1][0]  # after the final norm
    inputs = list(ids[1:])
    states = [hidden[i] for i in range(len(ids) - 1)]
    picked, first = [], None
    for _ in range(drafts):
        embeds = hf.model.embed_tokens(torch.tensor([inputs]))
        x = mtp.fc(torch.cat([mtp.pre_fc_norm_embedding(embeds),
                              mtp.pre_fc_norm_hidden(torch.stack(states)[None])], dim=-1))
        positions = torch.arange(x.shape[1])[None]
        rope = hf.model.rotary_emb(x, positions)
        out = mtp.norm(mtp.layers[0](x, position_embeddings=rope, position_ids=positions))[0]
        logits = hf.lm_head(out[-1])
        first = logits if first is None else first
        picked.append(int(logits.argmax()))
        inputs.append(picked[-1])
        states.append(out[-1])
    return first, picked
