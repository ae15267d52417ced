"""CLIP and SigLIP vision towers (the LLaVA family's encoders), on the shared ViT blocks.

Fixed-size images (or tiles) [B, 3, S, S] -> patch embeddings (a convolution with stride equal
to its kernel), a class token (CLIP), learned positions, a pre-norm (CLIP's `pre_layrnorm`),
then ViT blocks. LLaVA reads intermediate hidden states rather than the tower's output, so
`forward` runs only as many blocks as the deepest requested layer needs and returns those
layers' states concatenated on the feature axis. Index 0 is the embeddings (after the
pre-norm), index i the output of block i, negative indices count from the end: the layout of
transformers' `hidden_states`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from models.layers.vit import Segments, ViTConfig, vit_blocks
from models.loader import Shard


@dataclass(frozen=True)
class ClipVisionConfig:
    """A CLIP or SigLIP vision config, read once."""

    vit: ViTConfig
    image_size: int
    patch_size: int
    channels: int
    class_token: bool  # CLIP prepends a learned class token; SigLIP has none
    pre_norm: bool  # CLIP's LayerNorm after the embeddings
    patch_bias: bool

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions(self) -> int:
        return self.num_patches + int(self.class_token)

    @classmethod
    def from_hf(cls, vc) -> ClipVisionConfig:
        clip = vc.model_type in ("clip_vision_model", "clip")
        # Idefics3's and SmolVLM's towers are SigLIP's (on tiles of the tower's own size).
        siglip = ("siglip_vision_model", "siglip", "idefics3_vision", "smolvlm_vision",
                  "phi4_multimodal_vision")
        if not clip and vc.model_type not in siglip:
            raise NotImplementedError(
                f"vision tower {vc.model_type!r} is not supported (CLIP, SigLIP)"
            )
        vit = ViTConfig(
            width=vc.hidden_size, depth=vc.num_hidden_layers, num_heads=vc.num_attention_heads,
            mlp_hidden=vc.intermediate_size, act=vc.hidden_act, norm="layer",
            norm_eps=vc.layer_norm_eps,
        )
        return cls(vit, vc.image_size, vc.patch_size, vc.num_channels, class_token=clip,
                   pre_norm=clip, patch_bias=not clip)


class ClipVisionTower(nn.Module):
    """`final_norm`: keep the checkpoint's `post_layernorm` for towers whose consumer reads the
    last hidden state (Gemma 3) rather than an intermediate layer (LLaVA)."""

    def __init__(self, cfg: ClipVisionConfig, final_norm: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.final_norm = final_norm
        w = cfg.vit.width
        self.patch_embedding = nn.Conv2d(cfg.channels, w, cfg.patch_size, cfg.patch_size,
                                         bias=cfg.patch_bias)
        if cfg.class_token:
            self.class_embedding = nn.Parameter(torch.empty(w))
        self.position_embedding = nn.Embedding(cfg.num_positions, w)
        if cfg.pre_norm:
            self.pre_layrnorm = nn.LayerNorm(w, eps=cfg.vit.norm_eps)
        self.blocks = vit_blocks(cfg.vit)
        if final_norm:
            self.post_layernorm = nn.LayerNorm(w, eps=cfg.vit.norm_eps)

    def resolve_layers(self, layers: Sequence[int]) -> tuple[int, ...]:
        """Hidden-state indices, negative ones counted from the end, checked."""
        count = self.cfg.vit.depth + 1
        out = tuple(i + count if i < 0 else i for i in layers)
        if not all(0 <= i < count for i in out):
            raise ValueError(f"feature layers {list(layers)} are outside 0..{count - 1}")
        return out

    def forward(self, pixel_values: torch.Tensor, layers: tuple[int, ...]) -> torch.Tensor:
        """pixel_values [B, C, S, S] -> the requested hidden states [B, P, width * len(layers)]
        (`layers` resolved by `resolve_layers`)."""
        b = pixel_values.shape[0]
        x = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        x = x.flatten(2).transpose(1, 2)  # [B, patches, width]
        if self.cfg.class_token:
            x = torch.cat([self.class_embedding.expand(b, 1, -1), x], dim=1)
        x = x + self.position_embedding.weight[None]
        if self.cfg.pre_norm:
            x = self.pre_layrnorm(x)
        positions = x.shape[1]
        x = x.reshape(b * positions, -1)  # packed: every image is one segment
        seg = Segments([positions] * b)
        states = {0: x}
        for i, block in enumerate(self.blocks[: max(layers)], start=1):
            x = block(x, seg)
            states[i] = x
        return torch.cat([states[i] for i in layers], dim=-1).view(b, positions, -1)

    def last_hidden_state(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[B, C, S, S] -> the final block's output after `post_layernorm`: [B, P, width]."""
        return self.post_layernorm(self(pixel_values, (self.cfg.vit.depth,)))

    def checkpoint_name(self, name: str) -> tuple[str, Shard | None] | None:
        """A name inside the checkpoint's `vision_model.` -> ours (None: a tensor not used)."""
        width = self.cfg.vit.width
        if name.startswith("head.") or name.endswith("position_ids") or (
                name.startswith("post_layernorm.") and not self.final_norm):
            return None
        for prefix in ("embeddings.", ""):
            if name.startswith(prefix + "patch_embedding") or name.startswith(
                    prefix + "position_embedding") or name == prefix + "class_embedding":
                return name[len(prefix):], None
        if not name.startswith("encoder.layers."):
            return name, None
        layer, rest = name[len("encoder.layers."):].split(".", 1)
        block = f"blocks.{layer}."
        renames = {"layer_norm1": "norm1", "layer_norm2": "norm2", "mlp.fc1": "mlp.fc1",
                   "mlp.fc2": "mlp.fc2", "self_attn.out_proj": "attn.proj"}
        module, param = rest.rsplit(".", 1)
        if module in renames:
            return block + renames[module] + "." + param, None
        qkv = {"self_attn.q_proj": 0, "self_attn.k_proj": 1, "self_attn.v_proj": 2}
        if module in qkv:
            return block + "attn.qkv." + param, Shard(qkv[module] * width, width)
        raise ValueError(f"unexpected vision tower tensor {name}")


def select_features(states: torch.Tensor, strategy: str) -> torch.Tensor:
    """LLaVA's `vision_feature_select_strategy`: "default" drops the class token."""
    if strategy == "default":
        return states[:, 1:]
    if strategy == "full":
        return states
    raise ValueError(
        f"vision_feature_select_strategy must be 'default' or 'full', got {strategy!r}"
    )


def vlm_checkpoint_map(model: nn.Module, own: tuple[str, ...]) -> Callable:
    """The weight map of a decoder with a CLIP/SigLIP `vision_tower`, in both layouts: the
    Hub's (language_model.model.*, language_model.lm_head.*, vision_tower[.vision_model].*,
    <own>*) and transformers 5's (model.language_model.*, lm_head.*,
    model.vision_tower[.vision_model].*, model.<own>*). `own` lists the model's other names."""
    hub_lm = model.weight_map(prefix="language_model.model.", lm_head="language_model.lm_head.")
    new_lm = model.weight_map(prefix="model.language_model.", lm_head="lm_head.")

    def mapping(name: str):
        if name.startswith("language_model."):
            return hub_lm(name)
        inner = name.removeprefix("model.")
        if inner.startswith("vision_tower."):  # "vision_model." follows in Hub checkpoints
            inner = inner[len("vision_tower."):].removeprefix("vision_model.")
            target = model.vision_tower.checkpoint_name(inner)
            return None if target is None else ("vision_tower." + target[0], target[1])
        if inner.startswith(own):
            return inner, None
        return new_lm(name)

    return mapping
