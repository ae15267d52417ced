"""The conformer audio encoder of Phi-4-multimodal, batched over every clip of a step.

A clip's log-mel frames [T, n_mels] are normalised by the checkpoint's global mean and inverse
deviation, subsampled `time_reduction` times in time (NeMo's convolutions: a stride-2 3x3
convolution, then depthwise stride-2 and pointwise convolutions, ReLU after each stage; the
frequency axis shrinks alike and is flattened into a linear to the encoder width), giving
ceil(T / time_reduction) positions. Those pass through conformer blocks:

    x + 1/2 FFN(x), then + attention with a learned relative-position bias (T5 style: one bias
    per head and clipped distance), + a causal depthwise convolution module (pointwise GLU with
    its own biases, depthwise convolution, activation, pointwise), + 1/2 FFN, LayerNorm

whose FFNs are LayerNorm, a gated linear unit (the first half of gate_up_proj is the value, the
second the gate) and a down projection. A clip longer than `MAX_POSITIONS` positions is cut into
windows of that many positions attended (and convolved) separately, the last window padded with
zeros that take part like positions, as transformers' implementation does.

Clips are packed into one sequence [N, width] (every linear runs once for the step); attention
and convolutions run window by window over views, each window alone as in transformers with one
clip (its features unpadded by other clips).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.kernels.linear import EncoderLinear
from models.layers.mlp import ACTIVATIONS

MAX_POSITIONS = 500  # positions attended together (transformers' `max_seq_len`)
_ACTIVATIONS = {"swish": F.silu, "relu": F.relu, **ACTIVATIONS}


@dataclass(frozen=True)
class ConformerConfig:
    """The encoder's shape, read once from the checkpoint's audio_config."""

    width: int
    intermediate: int
    depth: int
    num_heads: int
    n_mels: int
    time_reduction: int
    conv_channels: int
    kernel_size: int
    depthwise_multiplier: int
    bias_max_distance: int
    bias_symmetric: bool
    activation: str
    conv_activation: str
    glu_activation: str
    subsampling_activation: str

    @classmethod
    def from_hf(cls, ac) -> ConformerConfig:
        """From a Phi4MultimodalAudioConfig; settings whose other values we do not implement
        are refused with their name."""
        fixed = {"chunk_size": -1, "downsample_rate": 1}
        for key, value in fixed.items():
            if getattr(ac, key) != value:
                raise NotImplementedError(
                    f"config.json audio_config.{key}={getattr(ac, key)!r} is not supported "
                    f"(mmserve implements the conformer with {key}={value} only)")
        if ac.ext_pw_out_channel != ac.hidden_size or (
                ac.depthwise_separable_out_channel != ac.hidden_size):
            raise NotImplementedError(
                "audio_config.ext_pw_out_channel and depthwise_separable_out_channel must equal "
                f"hidden_size={ac.hidden_size} (the block's residual adds them to it)")
        steps = math.log2(ac.time_reduction)
        if steps != int(steps) or steps < 1:
            raise ValueError(f"audio_config.time_reduction={ac.time_reduction} must be a power "
                             "of 2")
        for key in ("activation", "conv_activation", "conv_glu_type", "nemo_activation"):
            if getattr(ac, key) not in _ACTIVATIONS:
                raise NotImplementedError(f"audio_config.{key}={getattr(ac, key)!r} is not "
                                          f"supported ({', '.join(_ACTIVATIONS)})")
        return cls(ac.hidden_size, ac.intermediate_size, ac.num_blocks, ac.num_attention_heads,
                   ac.input_size, ac.time_reduction, ac.nemo_conv_channels, ac.kernel_size,
                   ac.depthwise_multiplier, ac.bias_max_distance, ac.bias_symmetric,
                   ac.activation, ac.conv_activation, ac.conv_glu_type, ac.nemo_activation)

    def num_positions(self, num_frames: int) -> int:
        """Positions (= embeddings) of a clip of `num_frames` frames: each stride-2 step of the
        subsampling rounds up."""
        for _ in range(int(math.log2(self.time_reduction))):
            num_frames = -(-num_frames // 2)
        return num_frames

    @property
    def freq_out(self) -> int:
        """The frequency bins left after subsampling."""
        n = self.n_mels
        for _ in range(int(math.log2(self.time_reduction))):
            n = (n - 1) // 2 + 1
        return n


class MeanVarianceNorm(nn.Module):
    """(x - global_mean) * global_invstd: the checkpoint's statistics (parameters here, so that
    the loader fills them; nothing trains them)."""

    def __init__(self, n_mels: int) -> None:
        super().__init__()
        self.global_mean = nn.Parameter(torch.zeros(n_mels), requires_grad=False)
        self.global_invstd = nn.Parameter(torch.ones(n_mels), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.global_mean) * self.global_invstd


class Subsampling(nn.Module):
    """NeMo's convolutional subsampling by `time_reduction` (the checkpoint's `embed.`)."""

    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        c = cfg.conv_channels
        act = _Activation(cfg.subsampling_activation)
        layers: list[nn.Module] = [nn.Conv2d(1, c, 3, 2, 1), act]
        for _ in range(int(math.log2(cfg.time_reduction)) - 1):
            layers += [nn.Conv2d(c, c, 3, 2, 1, groups=c), nn.Conv2d(c, c, 1), act]
        self.conv = nn.Sequential(*layers)
        self.out = EncoderLinear(c * cfg.freq_out, cfg.width)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        """frames [T, n_mels] (one clip) -> [ceil(T / reduction), width]."""
        x = self.conv(frames[None, None])  # [1, C, T', F']
        return self.out(x[0].transpose(0, 1).flatten(1))


class _Activation(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.fn = _ACTIVATIONS[name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class FeedForward(nn.Module):
    """LayerNorm, gate_up_proj (value half then gate half), activation, down_proj."""

    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(cfg.width)
        self.gate_up_proj = EncoderLinear(cfg.width, 2 * cfg.intermediate)
        self.down_proj = EncoderLinear(cfg.intermediate, cfg.width)
        self.act = _ACTIVATIONS[cfg.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.gate_up_proj(self.layer_norm(x)).chunk(2, dim=-1)
        return self.down_proj(value * self.act(gate))


class Attention(nn.Module):
    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        w = cfg.width
        self.num_heads, self.head_dim = cfg.num_heads, w // cfg.num_heads
        self.q_proj, self.k_proj = EncoderLinear(w, w), EncoderLinear(w, w)
        self.v_proj, self.o_proj = EncoderLinear(w, w), EncoderLinear(w, w)

    def forward(self, x: torch.Tensor, windows: list[int], bias: dict[int, torch.Tensor]):
        """x [N, width] packed windows -> [N, width]; bias[L]: [1, H, L, L] per length."""
        shape = (x.shape[0], self.num_heads, self.head_dim)
        q, k, v = (p(x).view(shape) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = []
        for part in zip(q.split(windows), k.split(windows), v.split(windows), strict=True):
            qw, kw, vw = (t.transpose(0, 1)[None] for t in part)  # [1, H, L, D]
            o = F.scaled_dot_product_attention(qw, kw, vw, attn_mask=bias[qw.shape[2]])
            out.append(o[0].transpose(0, 1))
        return self.o_proj(torch.cat(out).reshape(x.shape[0], -1))


class GluPointwise(nn.Module):
    """A pointwise convolution to twice the width: (first half + b1) * act(second half + b2)."""

    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        self.ext_pw_conv_1d = nn.Conv1d(cfg.width, 2 * cfg.width, 1)
        self.b1 = nn.Parameter(torch.zeros(1, cfg.width, 1))
        self.b2 = nn.Parameter(torch.zeros(1, cfg.width, 1))
        self.act = _ACTIVATIONS[cfg.glu_activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, width] -> [N, width] (pointwise: windows need no separation)."""
        y = self.ext_pw_conv_1d(x.t()[None])  # [1, 2W, N]
        value, gate = y.chunk(2, dim=1)
        return ((value + self.b1) * self.act(gate + self.b2))[0].t()


class DepthwiseSeparable(nn.Module):
    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        w, k = cfg.width, cfg.kernel_size
        self.dw_conv = nn.Conv1d(w, w * cfg.depthwise_multiplier, k, padding=k - 1, groups=w)
        self.pw_conv = nn.Conv1d(w * cfg.depthwise_multiplier, w, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One window [L, width] -> [L, width], causal (the right padding's outputs cut)."""
        length = x.shape[0]
        return self.pw_conv(self.dw_conv(x.t()[None]))[0, :, :length].t()


class ConvModule(nn.Module):
    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        self.layer_norm = nn.LayerNorm(cfg.width)
        self.glu = GluPointwise(cfg)
        self.dw_sep_conv_1d = DepthwiseSeparable(cfg)
        self.ext_pw_conv_1d = nn.Conv1d(cfg.width, cfg.width, 1)
        self.act = _ACTIVATIONS[cfg.conv_activation]

    def forward(self, x: torch.Tensor, windows: list[int]) -> torch.Tensor:
        h = self.glu(self.layer_norm(x))
        h = torch.cat([self.dw_sep_conv_1d(part) for part in h.split(windows)])
        return self.ext_pw_conv_1d(self.act(h).t()[None])[0].t()


class ConformerBlock(nn.Module):
    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        self.feed_forward_in = FeedForward(cfg)
        self.self_attn = Attention(cfg)
        self.conv = ConvModule(cfg)
        self.feed_forward_out = FeedForward(cfg)
        self.layer_norm_att = nn.LayerNorm(cfg.width)
        self.layer_norm = nn.LayerNorm(cfg.width)

    def forward(self, x, windows: list[int], bias: dict[int, torch.Tensor]) -> torch.Tensor:
        x = x + 0.5 * self.feed_forward_in(x)
        x = x + self.self_attn(self.layer_norm_att(x), windows, bias)
        x = x + self.conv(x, windows)
        x = x + 0.5 * self.feed_forward_out(x)
        return self.layer_norm(x)


class RelativeBias(nn.Module):
    """T5-style relative-position bias: one learned value per head and clipped distance."""

    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        self.max_distance, self.symmetric = cfg.bias_max_distance, cfg.bias_symmetric
        buckets = self.max_distance if self.symmetric else 2 * self.max_distance
        self.bias_values = nn.Embedding(buckets, cfg.num_heads)

    def forward(self, length: int) -> torch.Tensor:
        """-> [1, H, L, L]: the bias of key j for query i."""
        pos = torch.arange(length, device=self.bias_values.weight.device)
        rel = (pos[None, :] - pos[:, None]).clamp(-self.max_distance, self.max_distance - 1)
        index = rel.abs() if self.symmetric else rel + self.max_distance
        return self.bias_values(index).permute(2, 0, 1)[None]


class ConformerEncoder(nn.Module):
    """The checkpoint's `encoder.`: norm, subsampling, relative bias, conformer blocks."""

    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder_embedding = MeanVarianceNorm(cfg.n_mels)
        self.embed = Subsampling(cfg)
        self.relative_attention_bias_layer = RelativeBias(cfg)
        self.encoders = nn.ModuleList(ConformerBlock(cfg) for _ in range(cfg.depth))

    def forward(self, clips: list[torch.Tensor]) -> list[torch.Tensor]:
        """Log-mel frames [T_i, n_mels] per clip -> encoder states [ceil(T_i / r), width]."""
        dtype = self.embed.out.weight.dtype
        states = [self.embed(self.encoder_embedding(c.to(dtype))) for c in clips]
        lengths = [s.shape[0] for s in states]
        pieces, windows = [], []
        for s in states:
            for first in range(0, len(s), MAX_POSITIONS):
                window = s[first:first + MAX_POSITIONS]
                if len(s) > MAX_POSITIONS and len(window) < MAX_POSITIONS:
                    window = F.pad(window, (0, 0, 0, MAX_POSITIONS - len(window)))
                pieces.append(window)
                windows.append(len(window))
        x = torch.cat(pieces)  # [N, width]
        bias = {n: self.relative_attention_bias_layer(n).to(dtype) for n in set(windows)}
        for block in self.encoders:
            x = block(x, windows, bias)
        out, offset = [], 0
        for n in lengths:
            padded = -(-n // MAX_POSITIONS) * MAX_POSITIONS if n > MAX_POSITIONS else n
            out.append(x[offset:offset + n])
            offset += padded
        return out
