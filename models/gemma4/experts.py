"""Gemma 4's mixture-of-experts layers (26B-A4B, `enable_moe_block`): the routed experts run
beside the dense MLP, each with its own norms, and their outputs are summed before the layer's
post-feed-forward norm:

    h + post_ffw_norm(post_ffw_norm_1(mlp(pre_ffw_norm(h)))
                      + post_ffw_norm_2(experts(pre_ffw_norm_2(h), router(h))))

The router RMS-normalizes its input without a weight, scales it by a learned vector and
1 / sqrt(hidden), takes a softmax over the experts in float32, the top k renormalized to sum to
1 and multiplied by a learned per-expert scale. The experts are the shared block's
(models/layers/moe.py: quantized while loading, each active expert run once over its tokens,
a token reading only its routed experts' weights); the router's projection stays in the model
dtype. The routed weights reach the experts in the model dtype (the reference multiplies each
expert's output by the float32 weight, then rounds: the same in float32, within a rounding in
bfloat16).
"""

from __future__ import annotations

import torch
from torch import nn

from models.kernels.linear import Linear
from models.layers.decoder_config import DecoderConfig
from models.layers.decoder_layer import DecoderLayer
from models.layers.moe import MoEShape, RoutedExperts
from models.layers.norm import RMSNorm, rms_norm_unscaled


def moe_shape(text) -> MoEShape:
    """The experts of a Gemma4TextConfig (`num_experts`, `top_k_experts`,
    `moe_intermediate_size`); the router always renormalizes its top k."""
    return MoEShape(text.num_experts, text.top_k_experts, text.moe_intermediate_size, True)


class Router(nn.Module):
    def __init__(self, hidden: int, shape: MoEShape, eps: float) -> None:
        super().__init__()
        self.proj = Linear(hidden, shape.num_experts, bias=False, quantizable=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(shape.num_experts))
        self.top_k, self.eps, self.root = shape.top_k, eps, hidden**-0.5

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, H] -> (weights [T, k] float32, experts [T, k] int64)."""
        x = rms_norm_unscaled(h, self.eps) * self.scale * self.root
        probs = torch.softmax(self.proj(x), dim=-1, dtype=torch.float32)
        top, experts = torch.topk(probs, self.top_k, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        return top * self.per_expert_scale[experts], experts


class ExpertsLayer(DecoderLayer):
    """A decoder layer whose feed-forward block is the dense MLP beside routed experts."""

    def __init__(self, cfg: DecoderConfig, layout, rope_index: int, index: int,
                 shape: MoEShape) -> None:
        super().__init__(cfg, layout, rope_index, index)
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused_decode=True,  # noqa: E731
                               float32_scale=cfg.norm_float32_scale)
        self.router = Router(cfg.hidden_size, shape, cfg.rms_norm_eps)
        self.experts = RoutedExperts(cfg.hidden_size, shape, cfg.hidden_act)
        self.pre_feedforward_layernorm_2 = norm()
        self.post_feedforward_layernorm_1 = norm()
        self.post_feedforward_layernorm_2 = norm()

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        dense = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h)))
        weights, experts = self.router(h)
        routed = self.experts.routed(self.pre_feedforward_layernorm_2(h),
                                     weights.to(h.dtype), experts)
        return dense + self.post_feedforward_layernorm_2(routed)
