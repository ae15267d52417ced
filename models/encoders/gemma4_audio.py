"""The conformer audio encoder of Gemma 4's E-size models (Gemma4AudioModel): log-mel frames ->
embeddings at a quarter of the frame rate.

A clip's frames [T, n_mels] go through two stride-2 3x3 convolutions (each masking its input's
padding frames, a LayerNorm over channels, ReLU) and a projection; then conformer blocks: a
half-weighted feed-forward, local self-attention, a light causal depthwise convolution, another
half-weighted feed-forward and a norm.

Attention is causal within a window: a position attends to itself and the
`attention_context_left - 2` before it. Its scores are the sum of content (q . k) and
relative-position (q . R[d], R a projection of sinusoidal embeddings) terms, soft-capped. The
reference computes them per block of `attention_chunk_size` queries with a table of M + 1
relative positions, M half its block context, which gives distance d the embedding of
d + M - P (P = attention_context_left - 1) and no relative term where d < P - M; with Gemma 4's
settings M = P. Queries are scaled per dimension (softplus(per_dim_scale)) and keys by a
constant, in float32. Every linear optionally clamps its input and output to the checkpoint's
bounds.

Everything is causal or local, so a clip's real positions do not depend on the padding after
it: the clips of a step run as one padded batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.encoders.gemma4_vision import ClippedLinear
from models.kernels.linear import EncoderLinear
from models.layers.mlp import ACTIVATIONS
from models.layers.norm import RMSNorm

INVALID_LOGIT = -1.0e9  # masked scores (the reference's attention_invalid_logits_value default)


@dataclass(frozen=True)
class ConformerConfig:
    """The encoder's shape, read from a Gemma4AudioConfig."""

    width: int
    depth: int
    num_heads: int
    act: str
    conv_channels: tuple[int, int]
    conv_kernel: int
    residual_weight: float
    left: int  # keys the query sees: itself and left - 1 before it (P)
    relative_positions: int  # M: half the reference's block context
    softcap: float
    invalid_logit: float
    clipped: bool
    eps: float
    clip_value: float  # `gradient_clipping`: activations clamped to +-this
    out_dim: int

    @classmethod
    def from_hf(cls, ac) -> ConformerConfig:
        channels = tuple(ac.subsampling_conv_channels)
        if len(channels) != 2:
            raise NotImplementedError(f"subsampling_conv_channels={list(channels)} (two "
                                      "convolutions only, as the reference builds)")
        if ac.attention_context_right != 0:
            raise NotImplementedError(
                f"audio_config.attention_context_right={ac.attention_context_right} (attention "
                "to later frames) is not supported; Gemma 4's encoders attend backwards only")
        horizon = ac.attention_context_left - 1
        return cls(ac.hidden_size, ac.num_hidden_layers, ac.num_attention_heads, ac.hidden_act,
                   channels, ac.conv_kernel_size, ac.residual_weight, horizon,
                   (ac.attention_chunk_size + horizon) // 2,
                   ac.attention_logit_cap, ac.attention_invalid_logits_value,
                   bool(ac.use_clipped_linears), ac.rms_norm_eps, ac.gradient_clipping,
                   ac.output_proj_dims)

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    def accepts_mel_bins(self, n_mels: int) -> bool:
        """Whether features of `n_mels` bins fit the projection (channels[0] // 4 rows)."""
        return subsampled(n_mels) == self.conv_channels[0] // 4


def _norm(dim: int, eps: float = 1e-6) -> RMSNorm:
    return RMSNorm(dim, eps, float32_scale=True)


def _clamp(x: torch.Tensor, bound: float) -> torch.Tensor:
    bound = min(bound, torch.finfo(x.dtype).max)
    return torch.clamp(x, -bound, bound)


class SubsampleLayer(nn.Module):
    def __init__(self, c_in: int, c_out: int, eps: float) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False)
        self.norm = nn.LayerNorm(c_out, eps=eps, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor):
        """x [B, C, T, F], mask [B, T] -> ([B, C', ceil(T/2), ceil(F/2)], mask [B, ceil(T/2)])."""
        x = self.conv((x * mask[:, None, :, None]).to(self.conv.weight.dtype))
        x = F.relu(self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))
        return x, mask[:, ::2]


def subsampled(n: int) -> int:
    """Positions left of n after the two stride-2 convolutions."""
    half = (n + 1) // 2
    return (half + 1) // 2


class SubsampleProjection(nn.Module):
    """[B, T, n_mels] -> [B, subsampled(T), width]. The projection takes channels[0] // 4
    frequency rows (the reference sizes it so): `n_mels` must subsample to that many."""

    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        c0, c1 = cfg.conv_channels
        self.layer0 = SubsampleLayer(1, c0, cfg.eps)
        self.layer1 = SubsampleLayer(c0, c1, cfg.eps)
        self.input_proj_linear = EncoderLinear(c0 // 4 * c1, cfg.width, bias=False)

    def forward(self, features: torch.Tensor, mask: torch.Tensor):
        x, mask = self.layer0(features[:, None], mask)
        x, mask = self.layer1(x, mask)
        b, _, t, _ = x.shape
        return self.input_proj_linear(x.permute(0, 2, 3, 1).reshape(b, t, -1)), mask


class FeedForward(nn.Module):
    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.pre_layer_norm, self.post_layer_norm = _norm(cfg.width), _norm(cfg.width)
        self.ffw_layer_1 = ClippedLinear(cfg.width, 4 * cfg.width, cfg.clipped)
        self.ffw_layer_2 = ClippedLinear(4 * cfg.width, cfg.width, cfg.clipped)
        self.act = ACTIVATIONS[cfg.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bound = self.cfg.clip_value
        h = self.pre_layer_norm(_clamp(x, bound))
        h = _clamp(self.ffw_layer_2(self.act(self.ffw_layer_1(h))), bound)
        return x + self.post_layer_norm(h) * self.cfg.residual_weight


class LocalAttention(nn.Module):
    """Banded attention with relative-position scores, in float32 (see the module docstring)."""

    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        w, d = cfg.width, cfg.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.post = (
            ClippedLinear(w, w, cfg.clipped) for _ in range(4))
        self.relative_k_proj = EncoderLinear(w, w, bias=False)
        self.per_dim_scale = nn.Parameter(torch.zeros(d))
        self.q_scale = d**-0.5 / math.log(2)
        self.k_scale = math.log(1 + math.e) / math.log(2)

    def forward(self, x: torch.Tensor, distances: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """x [B, T, W], distances [P, W] (the embeddings of distances P - 1 .. 0, see the
        module docstring), mask [B, T] -> [B, T, W]."""
        cfg, (b, t, _) = self.cfg, x.shape
        h, d, span = cfg.num_heads, cfg.head_dim, cfg.left
        q = self.q_proj(x).float().view(b, t, h, d)
        q = q * self.q_scale * F.softplus(self.per_dim_scale.float())
        k = self.k_proj(x).float().view(b, t, h, d) * self.k_scale
        v = self.v_proj(x).float().view(b, t, h, d)
        # Keys of every query: positions t - left + 1 .. t, gathered as a band.
        pad = (0, 0, 0, 0, span - 1, 0)
        keys = F.pad(k, pad).unfold(1, span, 1)  # [B, T, H, D, span]
        values = F.pad(v, pad).unfold(1, span, 1)
        rel = self.relative_k_proj(distances).float().view(span, h, d)  # [span, H, D]
        near = torch.arange(span - 1, -1, -1, device=x.device) < span - cfg.relative_positions
        rel = rel.masked_fill(near[:, None, None], 0.0)  # outside the reference's table
        scores = torch.einsum("bthd,bthds->bths", q, keys)
        scores = scores + torch.einsum("bthd,shd->bths", q, rel)
        scores = torch.tanh(scores / cfg.softcap) * cfg.softcap
        valid = F.pad(mask, (span - 1, 0)).unfold(1, span, 1)  # [B, T, span]
        scores = scores.masked_fill(~valid[:, :, None, :], cfg.invalid_logit)
        probs = scores.softmax(dim=-1)
        out = torch.einsum("bths,bthds->bthd", probs, values).reshape(b, t, -1)
        return self.post(out.to(x.dtype))


class LightConv(nn.Module):
    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.pre_layer_norm = _norm(cfg.width, cfg.eps)
        self.conv_norm = _norm(cfg.width, cfg.eps)
        self.linear_start = ClippedLinear(cfg.width, 2 * cfg.width, cfg.clipped)
        self.linear_end = ClippedLinear(cfg.width, cfg.width, cfg.clipped)
        self.depthwise_conv1d = nn.Conv1d(cfg.width, cfg.width, cfg.conv_kernel,
                                          groups=cfg.width, bias=False)
        self.act = ACTIVATIONS[cfg.act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.linear_start(self.pre_layer_norm(x)), dim=-1)
        h = F.pad(h.transpose(1, 2), (self.cfg.conv_kernel - 1, 0))  # causal
        h = _clamp(self.depthwise_conv1d(h).transpose(1, 2), self.cfg.clip_value)
        return x + self.linear_end(self.act(self.conv_norm(h)))


class ConformerLayer(nn.Module):
    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.feed_forward1, self.feed_forward2 = FeedForward(cfg), FeedForward(cfg)
        self.self_attn = LocalAttention(cfg)
        self.lconv1d = LightConv(cfg)
        self.norm_pre_attn, self.norm_post_attn = _norm(cfg.width), _norm(cfg.width)
        self.norm_out = _norm(cfg.width)

    def forward(self, x, distances, mask) -> torch.Tensor:
        bound = self.cfg.clip_value
        x = self.feed_forward1(x)
        attn = self.self_attn(self.norm_pre_attn(_clamp(x, bound)), distances, mask)
        x = x + self.norm_post_attn(_clamp(attn, bound))
        x = self.feed_forward2(self.lconv1d(x))
        return self.norm_out(_clamp(x, bound))


class ConformerEncoder(nn.Module):
    """Padded clips [B, T, n_mels] with their frame masks [B, T] -> (states [B, T', out_dim],
    mask [B, T']), T' = subsampled(T)."""

    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.subsample_conv_projection = SubsampleProjection(cfg)
        self.layers = nn.ModuleList(ConformerLayer(cfg) for _ in range(cfg.depth))
        self.output_proj = EncoderLinear(cfg.width, cfg.out_dim, bias=True)
        # Sinusoidal embeddings of the distances the band covers, [sin | cos], built on the CPU
        # (the encoder is built on the meta device).
        half = cfg.width // 2
        step = math.log(10000.0) / max(half - 1, 1)
        inv = torch.exp(torch.arange(half, dtype=torch.float32, device="cpu") * -step)
        shift = cfg.relative_positions - cfg.left
        dist = torch.arange(cfg.left - 1, -1, -1, dtype=torch.float32, device="cpu") + shift
        angles = dist[:, None] * inv[None, :]
        self.distance_table = torch.cat([angles.sin(), angles.cos()], dim=-1)  # [span, W]

    def forward(self, features: torch.Tensor, mask: torch.Tensor):
        x, mask = self.subsample_conv_projection(features, mask)
        distances = self.distance_table.to(x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, distances, mask)
        return self.output_proj(x), mask
