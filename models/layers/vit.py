"""The transformer encoder shared by every vision and audio tower: pre-norm blocks over a packed
sequence of several items at once.

A step's items (images, frames, windows, audio clips, from any requests) are concatenated into
one sequence [N, width]; every matmul runs once for all of them, while attention never crosses
an item: `Segments` says where each one starts and ends, built on the host. Equal-length
segments (fixed-size images) attend as one batched SDPA over a view; unequal ones either pad
into a batch with a key mask (`pad=True`, one SDPA call) or run one SDPA per segment over views
(`pad=False`, cheaper when lengths differ a lot: a long clip does not make short ones pay).

Blocks are assembled from options: LayerNorm or RMSNorm, plain or gated MLP, q/k/v fused into
one matmul (`qkv`, `proj`) or separate (`q_proj`, `k_proj`, `v_proj`, `out_proj`, for a key
projection without bias), linear layers with or without biases, optional rotary angles,
optional query pre-scaling. Towers map their
checkpoints' names onto these (see each family's `checkpoint_map`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.kernels.linear import EncoderLinear
from models.layers.mlp import ACTIVATIONS, GatedMLP
from models.layers.norm import RMSNorm
from models.layers.transfer import to_device


@dataclass
class Segments:
    """Host-built description of how a packed sequence splits into independent segments."""

    lengths: list[int]
    gather: torch.Tensor | None = None  # [S * L] int64: padded slot -> row (padding -> row 0)
    scatter: torch.Tensor | None = None  # [N] int64: row -> padded slot
    # [S, 1, 1, L] bool key mask: the padding of `build`'s batch, or, for equal segments, the
    # keys each segment attends to (a crop's real patches).
    mask: torch.Tensor | None = None

    @classmethod
    def build(cls, lengths: list[int], device: torch.device, pad: bool = True) -> Segments:
        if not pad or len(set(lengths)) == 1:
            return cls(list(lengths))
        num, longest = len(lengths), max(lengths)
        gather = torch.zeros(num, longest, dtype=torch.int64)
        scatter = torch.empty(sum(lengths), dtype=torch.int64)
        offset = 0
        for s, n in enumerate(lengths):
            gather[s, :n] = torch.arange(offset, offset + n)
            scatter[offset : offset + n] = torch.arange(s * longest, s * longest + n)
            offset += n
        valid = torch.arange(longest)[None, :] < torch.tensor(lengths)[:, None]
        return cls(list(lengths), to_device(gather.view(-1), device), to_device(scatter, device),
                   to_device(valid[:, None, None, :], device))


def segment_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: Segments, scale: float | None = None
) -> torch.Tensor:
    """q/k/v [N, H, D] packed -> [N, H, D]; each segment attends only to itself, both ways."""
    n, heads, dim = q.shape
    if len(set(seg.lengths)) == 1:  # equal segments: a view, no copies
        shape = (len(seg.lengths), seg.lengths[0], heads, dim)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))  # [S, H, L, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=seg.mask, scale=scale)
        return out.transpose(1, 2).reshape(n, heads, dim)
    if seg.gather is None:  # one call per segment; 4-D: the CPU's fused kernel needs a batch
        return torch.cat([
            F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in part), scale=scale)
            [0].transpose(0, 1)
            for part in zip(q.split(seg.lengths), k.split(seg.lengths), v.split(seg.lengths),
                            strict=True)
        ])
    longest = seg.gather.shape[0] // len(seg.lengths)
    shape = (len(seg.lengths), longest, heads, dim)
    q, k, v = (t[seg.gather].view(shape).transpose(1, 2) for t in (q, k, v))  # [S, H, L, D]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=seg.mask, scale=scale)
    return out.transpose(1, 2).reshape(-1, heads, dim)[seg.scatter]


@dataclass(frozen=True)
class ViTConfig:
    """One encoder's block options (see the module docstring)."""

    width: int
    depth: int
    num_heads: int
    mlp_hidden: int
    act: str
    norm: str = "layer"  # "layer" or "rms"
    norm_eps: float = 1e-6
    gated_mlp: bool = False
    fused_qkv: bool = True
    k_bias: bool = True  # separate projections only: Whisper's key has no bias
    bias: bool = True  # on every attention and MLP linear layer (Pixtral has none)
    rotary: bool = False  # blocks take (cos, sin) and rotate q and k

    def __post_init__(self) -> None:
        if self.width % self.num_heads:
            raise ValueError(f"width {self.width} is not a multiple of {self.num_heads} heads")
        if self.norm not in ("layer", "rms"):
            raise ValueError(f"norm must be 'layer' or 'rms', got {self.norm!r}")
        if self.act not in ACTIVATIONS:
            raise ValueError(f"unknown activation {self.act!r} ({', '.join(ACTIVATIONS)})")


def make_norm(cfg: ViTConfig) -> nn.Module:
    if cfg.norm == "rms":
        return RMSNorm(cfg.width, cfg.norm_eps)
    return nn.LayerNorm(cfg.width, eps=cfg.norm_eps)


class ViTAttention(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.num_heads, self.head_dim = cfg.num_heads, cfg.width // cfg.num_heads
        w = cfg.width
        if cfg.fused_qkv:
            self.qkv = EncoderLinear(w, 3 * w, bias=cfg.bias)
            self.proj = EncoderLinear(w, w, bias=cfg.bias)
        else:
            self.q_proj, self.v_proj = EncoderLinear(w, w, cfg.bias), EncoderLinear(w, w, cfg.bias)
            self.k_proj = EncoderLinear(w, w, bias=cfg.k_bias and cfg.bias)
            self.out_proj = EncoderLinear(w, w, bias=cfg.bias)

    def forward(self, x: torch.Tensor, seg: Segments, rotary=None) -> torch.Tensor:
        n, shape = x.shape[0], (x.shape[0], self.num_heads, self.head_dim)
        if self.cfg.fused_qkv:
            q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        else:
            q, k, v = (p(x).view(shape) for p in (self.q_proj, self.k_proj, self.v_proj))
        if rotary is not None:
            q, k = rotate_half_float(q, *rotary), rotate_half_float(k, *rotary)
        out = segment_attention(q, k, v, seg).reshape(n, -1)
        return self.proj(out) if self.cfg.fused_qkv else self.out_proj(out)


def rotate_half_float(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary in float32 (as the references do); x [N, H, D], cos/sin [N, 1, D/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class PlainMLP(nn.Module):
    def __init__(self, width: int, hidden: int, act: str, bias: bool = True) -> None:
        super().__init__()
        self.fc1, self.fc2 = EncoderLinear(width, hidden, bias), EncoderLinear(hidden, width, bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(ACTIVATIONS[self.act](self.fc1(x)))


class ViTBlock(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.norm1, self.norm2 = make_norm(cfg), make_norm(cfg)
        self.attn = ViTAttention(cfg)
        self.mlp = (GatedMLP(cfg.width, cfg.mlp_hidden, bias=cfg.bias, act=cfg.act)
                    if cfg.gated_mlp else PlainMLP(cfg.width, cfg.mlp_hidden, cfg.act, cfg.bias))

    def forward(self, x: torch.Tensor, seg: Segments, rotary=None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), seg, rotary)
        x = x + self.mlp(self.norm2(x))
        if x.dtype == torch.float16:  # deep stacks overflow float16; the references clamp too
            bound = torch.finfo(x.dtype).max - 1000
            x = x.clamp(-bound, bound)
        return x


def vit_blocks(cfg: ViTConfig) -> nn.ModuleList:
    return nn.ModuleList(ViTBlock(cfg) for _ in range(cfg.depth))
