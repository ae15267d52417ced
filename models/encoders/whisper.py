"""The Whisper-style audio encoder (Whisper's own, Qwen2-Audio's, and Qwen2.5-Omni's), batched over
every clip of a step.

Two convolutions (the second halves the frame rate), positions (learned, or the fixed sinusoids
of Qwen2.5-Omni: `positions`), pre-LN transformer layers (the shared ViT blocks), average pooling
by 2 (not in Whisper's own encoder: `pool`), a final LayerNorm and, where the checkpoint has one
(Qwen2.5-Omni), a projection into the LLM's width (`output_dim`). A clip of L mel frames gives
(L + 1) // 2 encoder positions and half as many embeddings (`encoder_lengths`). Qwen2.5-Omni's
encoder attends within windows of 2 * n_window frames whose positions restart at 0: its processor
hands each window over as a clip of its own (models/qwen_omni/processor.py).

Nothing is padded, neither to the 30 s window nor to the step's longest clip: each clip's
features stop two frames past its real ones (the convolutions' reach: `receptive_frames`), so
its real outputs equal the full-window ones. The clips' positions are packed into one sequence
[N, width]: every matmul of the layers runs once for the whole step, while the convolutions
and attention, whose cost depends on a clip's own length, run clip by clip over views of it.
(Padding to the longest clip measured slower than a loop over clips on the CPU: a 30 s clip
next to 2 s ones multiplies the short ones' attention and convolution work.) Pooling pairs
never straddle a clip's end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from models.kernels.linear import EncoderLinear
from models.layers.transfer import to_device
from models.layers.vit import Segments, ViTConfig, vit_blocks


def encoder_lengths(num_frames: int) -> tuple[int, int]:
    """(encoder positions, output embeddings) for a clip of `num_frames` real mel frames."""
    positions = (num_frames - 1) // 2 + 1  # conv2: kernel 3, stride 2, padding 1
    return positions, positions // 2  # average pooling: kernel 2, stride 2


def receptive_frames(num_frames: int, window_frames: int) -> int:
    """Mel frames the clip's real outputs depend on: up to the last real position's conv
    reach (two kernel-3 convolutions, the second with stride 2), within the window."""
    positions, _ = encoder_lengths(num_frames)
    return min(2 * positions + 1, window_frames)


POSITIONS = ("learned", "sinusoidal")
# Audio configs whose encoder has fixed sinusoidal positions, windowed attention and an output
# projection (Qwen2.5-Omni's); the others are Whisper's (Qwen2-Audio's).
_OMNI_AUDIO = ("qwen2_5_omni_audio_encoder",)


@dataclass(frozen=True)
class AudioEncoderConfig:
    """The encoder's shape, read once from the checkpoint's audio_config."""

    num_mel_bins: int
    width: int
    num_layers: int
    num_heads: int
    ffn_dim: int
    max_positions: int
    activation: str
    positions: str = "learned"  # "sinusoidal": fixed, not in the checkpoint
    output_dim: int | None = None  # a projection after the final norm, into this width
    window_frames: int | None = None  # attention windows (in mel frames), one clip each
    pool: bool = True  # average pooling by 2 after the layers (False: Whisper's own encoder)

    def __post_init__(self) -> None:
        if self.positions not in POSITIONS:
            raise ValueError(f"positions must be one of {POSITIONS}, got {self.positions!r}")
        if self.window_frames is not None and encoder_lengths(self.window_frames)[0] > (
                self.max_positions):
            raise ValueError(f"a window of {self.window_frames} frames has more positions than "
                             f"max_source_positions={self.max_positions}")

    @classmethod
    def from_hf(cls, ac) -> AudioEncoderConfig:
        if ac.scale_embedding:
            raise NotImplementedError("audio encoders with scale_embedding are not built")
        omni = ac.model_type in _OMNI_AUDIO
        return cls(
            num_mel_bins=ac.num_mel_bins,
            width=ac.d_model,
            num_layers=ac.encoder_layers,
            num_heads=ac.encoder_attention_heads,
            ffn_dim=ac.encoder_ffn_dim,
            max_positions=ac.max_source_positions,
            activation=ac.activation_function,
            positions="sinusoidal" if omni else "learned",
            output_dim=ac.output_dim if omni else None,
            window_frames=2 * ac.n_window if omni else None,
        )

    @classmethod
    def from_whisper(cls, cfg) -> AudioEncoderConfig:
        """The encoder of a WhisperConfig (WhisperForConditionalGeneration): no pooling, every
        position of the 30 s window kept for the decoder's cross-attention."""
        if cfg.scale_embedding:
            raise NotImplementedError("Whisper checkpoints with scale_embedding are not built")
        return cls(num_mel_bins=cfg.num_mel_bins, width=cfg.d_model,
                   num_layers=cfg.encoder_layers, num_heads=cfg.encoder_attention_heads,
                   ffn_dim=cfg.encoder_ffn_dim, max_positions=cfg.max_source_positions,
                   activation=cfg.activation_function, pool=False)


@dataclass
class AudioBatch:
    """One step's clips, with the host-built indices that pack their encoder positions."""

    features: torch.Tensor  # [n_mels, sum(frames)] the clips' receptive frames, concatenated
    frames: list[int]  # mel frames per clip
    lengths: list[int]  # encoder positions per clip (N in all)
    positions: torch.Tensor  # [N] int64 position of each packed row within its clip
    pairs: torch.Tensor  # [sum(sizes), 2] int64 packed rows averaged into each embedding
    sizes: list[int]  # embeddings per clip


def build_audio_batch(
    features: list[torch.Tensor], num_frames: list[int], device: torch.device,
    dtype: torch.dtype, pool: bool = True,
) -> AudioBatch:
    """Concatenate clips' features ([n_mels, f_i] each); indices to pack their outputs
    (`pool` False: every encoder position is an output, as Whisper's own encoder keeps them)."""
    lengths, sizes = zip(*(encoder_lengths(n) for n in num_frames), strict=True)
    if not pool:
        sizes = lengths
    starts = accumulate(lengths[:-1], initial=0)  # first packed row of each clip
    positions = torch.cat([torch.arange(n) for n in lengths])
    if pool:
        firsts = torch.cat([s + 2 * torch.arange(n) for s, n in zip(starts, sizes, strict=True)])
        pairs = torch.stack([firsts, firsts + 1], dim=1)
    else:
        pairs = torch.zeros(0, 2, dtype=torch.int64)
    return AudioBatch(
        features=to_device(torch.cat(features, dim=1).to(dtype), device),
        frames=[f.shape[-1] for f in features], lengths=list(lengths),
        positions=to_device(positions, device), pairs=to_device(pairs, device),
        sizes=list(sizes),
    )


class AudioEncoder(nn.Module):
    """Mel features -> pooled, normalised encoder states (before the projector)."""

    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, cfg.width, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(cfg.width, cfg.width, kernel_size=3, stride=2, padding=1)
        if cfg.positions == "learned":
            self.embed_positions = nn.Embedding(cfg.max_positions, cfg.width)
        else:  # not a buffer: built on the CPU while the module is built on the meta device
            self.sinusoids = sinusoids(cfg.max_positions, cfg.width)  # float32, moved on use
        # Whisper's layers: LayerNorm (eps 1e-5), separate q/k/v with no key bias, plain MLP.
        self.blocks = vit_blocks(ViTConfig(
            width=cfg.width, depth=cfg.num_layers, num_heads=cfg.num_heads, mlp_hidden=cfg.ffn_dim,
            act=cfg.activation, norm="layer", norm_eps=1e-5, fused_qkv=False, k_bias=False,
        ))
        self.layer_norm = nn.LayerNorm(cfg.width)
        self.proj = None if cfg.output_dim is None else EncoderLinear(cfg.width, cfg.output_dim)

    def forward(self, batch: AudioBatch) -> torch.Tensor:
        """-> [sum(sizes), output_dim or width], clips in batch order."""
        clips = batch.features.split(batch.frames, dim=1)  # [n_mels, f_i] views
        # The frame kept past a clip's end yields one more position, never used.
        x = torch.cat([
            F.gelu(self.conv2(F.gelu(self.conv1(f))))[:, :n]  # [width, n_i]
            for f, n in zip(clips, batch.lengths, strict=True)
        ], dim=1).T  # [N, width]
        if self.cfg.positions == "learned":
            x = x + self.embed_positions(batch.positions)
        else:
            if self.sinusoids.device != x.device:
                self.sinusoids = self.sinusoids.to(x.device)
            x = x + self.sinusoids[batch.positions].to(x.dtype)
        clips = Segments(batch.lengths)  # one attention call per clip (see the module docstring)
        for block in self.blocks:
            x = block(x, clips)
        pooled = x[batch.pairs].mean(1) if self.cfg.pool else x  # [sum(sizes), width]
        out = self.layer_norm(pooled)
        return out if self.proj is None else self.proj(out)


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Fixed positions [length, channels] float32: sines then cosines of position times
    geometrically spaced inverse timescales (Whisper's, Qwen2.5-Omni's audio encoder)."""
    if channels % 2:
        raise ValueError(f"sinusoidal positions need an even width, got {channels}")
    step = math.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-step * torch.arange(channels // 2, device="cpu").float())
    scaled = torch.arange(length, device="cpu")[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)


_AUDIO_BLOCK_NAMES = {"self_attn_layer_norm": "norm1", "final_layer_norm": "norm2",
                      "self_attn": "attn", "fc1": "mlp.fc1", "fc2": "mlp.fc2"}


def whisper_block_name(name: str) -> str:
    """Whisper's `layers.N.<module>...` -> our shared blocks' `blocks.N.<module>...`."""
    if not name.startswith("layers."):
        return name
    _, index, module, rest = name.split(".", 3)
    return f"blocks.{index}.{_AUDIO_BLOCK_NAMES.get(module, module)}.{rest}"
