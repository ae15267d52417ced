"""Whisper-style log-mel features in torch, batched: what WhisperFeatureExtractor computes.

Each waveform (mono, at the extractor's rate, at most one window of `chunk_length` seconds) is
zero-padded to the window, framed by a centred STFT (periodic Hann window of `n_fft` samples,
hop `hop_length`), turned into a power spectrum and projected onto a Slaney mel filterbank.
The mel energies are compressed with log10 (floored at 1e-10), limited to 8 decades below the
clip's peak and rescaled by (x + 4) / 4. A frame is real when it starts inside the clip's
samples; the other frames of the window are padding (the frame mask). The whole batch goes
through one STFT and one filterbank matmul.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from models.checkpoint import Found, Schema, Settings, read_settings

# transformers' WhisperFeatureExtractor with its own defaults. The filterbank it builds in
# __init__ (`mel_filters`) and the window sizes derived from chunk_length (`n_samples`,
# `nb_max_frames`) are recomputed from these, so the saved copies change nothing; padding
# side and attention masks only shape a batch's output, and each clip is taken alone here.
FEATURE_EXTRACTOR = Schema("WhisperFeatureExtractor", {
    "feature_size": 80, "sampling_rate": 16000, "n_fft": 400, "hop_length": 160,
    "chunk_length": 30,
}, fixed={"padding_value": 0.0, "dither": 0.0},
    inert=frozenset({"mel_filters", "n_samples", "nb_max_frames"}))


@dataclass(frozen=True)
class MelConfig:
    """The extractor's parameters: the Whisper fields of a preprocessor_config.json."""

    n_mels: int = 80
    sample_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    chunk_length: int = 30  # seconds in one window

    @classmethod
    def from_settings(cls, s: Settings) -> MelConfig:
        """From WhisperFeatureExtractor's settings (FEATURE_EXTRACTOR), read from a checkpoint."""
        return cls(n_mels=int(s["feature_size"]), sample_rate=int(s["sampling_rate"]),
                   n_fft=int(s["n_fft"]), hop_length=int(s["hop_length"]),
                   chunk_length=int(s["chunk_length"]))

    @classmethod
    def from_preprocessor(cls, cfg: dict | None) -> MelConfig:
        """From a feature extractor's settings dict (e.g. its `to_dict()`)."""
        found = None if cfg is None else Found(cfg, "feature extractor settings")
        return cls.from_settings(read_settings(found, FEATURE_EXTRACTOR))

    @property
    def window_samples(self) -> int:
        return self.chunk_length * self.sample_rate

    @property
    def window_frames(self) -> int:
        return self.window_samples // self.hop_length

    def num_frames(self, num_samples: int) -> int:
        """Real frames of a clip of `num_samples` samples: those starting inside it."""
        return min(-(-num_samples // self.hop_length), self.window_frames)


def _hz_to_mel(hz: torch.Tensor) -> torch.Tensor:
    """Slaney's mel scale: linear (3 mels per 200 Hz) below 1 kHz, logarithmic above."""
    log_step = 27.0 / math.log(6.4)
    return torch.where(hz < 1000.0, 3.0 * hz / 200.0, 15.0 + torch.log(hz / 1000.0) * log_step)


def _mel_to_hz(mel: torch.Tensor) -> torch.Tensor:
    log_step = math.log(6.4) / 27.0
    return torch.where(mel < 15.0, 200.0 * mel / 3.0, 1000.0 * torch.exp(log_step * (mel - 15.0)))


def slaney_mel_filters(
    n_freqs: int, n_mels: int, sample_rate: int, f_min: float = 0.0, f_max: float = 8000.0
) -> torch.Tensor:
    """Triangular filters [n_freqs, n_mels] (float32), evenly spaced on the Slaney mel scale
    between `f_min` and `f_max` and area-normalised (weights scaled by 2 / bandwidth in Hz).
    Built in float64, as the reference filterbank is."""
    bounds = _hz_to_mel(torch.tensor([f_min, f_max], dtype=torch.float64))
    edges = _mel_to_hz(torch.linspace(bounds[0], bounds[1], n_mels + 2, dtype=torch.float64))
    lower, centre, upper = edges[:-2], edges[1:-1], edges[2:]  # [n_mels] Hz each
    freqs = torch.linspace(0, sample_rate // 2, n_freqs, dtype=torch.float64)[:, None]  # [F, 1]
    rising = (freqs - lower) / (centre - lower)  # [F, n_mels]
    falling = (upper - freqs) / (upper - centre)
    triangles = torch.minimum(rising, falling).clamp(min=0.0)
    return (triangles * (2.0 / (upper - lower))).float()


@dataclass
class LogMel:
    """Features of a batch of clips, each padded to one window."""

    features: torch.Tensor  # [B, n_mels, window_frames] float32
    num_frames: list[int]  # real frames per clip

    @property
    def mask(self) -> torch.Tensor:
        """[B, window_frames] int32: 1 on real frames (the reference's attention_mask)."""
        frames = self.features.shape[-1]
        return (torch.arange(frames)[None, :] < torch.tensor(self.num_frames)[:, None]).int()


class LogMelExtractor:
    """Turns mono waveforms into Whisper log-mel features; the filterbank is built once."""

    def __init__(self, cfg: MelConfig) -> None:
        self.cfg = cfg
        self.window = torch.hann_window(cfg.n_fft)
        self.filters = slaney_mel_filters(1 + cfg.n_fft // 2, cfg.n_mels, cfg.sample_rate)

    def __call__(self, waveforms: Sequence[np.ndarray]) -> LogMel:
        """Float32 waveforms of at most `window_samples` samples each -> their features."""
        cfg = self.cfg
        longest = max(len(w) for w in waveforms)
        if longest > cfg.window_samples:
            raise ValueError(
                f"a waveform of {longest} samples exceeds one {cfg.chunk_length} s window "
                f"({cfg.window_samples} samples); split it first"
            )
        # Only the frames that can see a sample are transformed: past `span` every frame is
        # silence (its reflected edge too), whose log-mel is the clip's floor, filled in below.
        span = min(cfg.window_samples, longest + cfg.n_fft)
        batch = torch.zeros(len(waveforms), span)  # [B, span] zero-padded
        for row, wave in zip(batch, waveforms, strict=True):
            row[: len(wave)] = torch.as_tensor(wave, dtype=torch.float32)
        spec = torch.stft(batch, cfg.n_fft, cfg.hop_length, window=self.window,
                          return_complex=True)[..., :-1]  # [B, F, span // hop], centred frames
        power = spec.real.square() + spec.imag.square()  # [B, F, T]
        mel = self.filters.T @ power  # [B, n_mels, T]
        log = mel.clamp(min=1e-10).log10()
        # Silence gives log10(1e-10) = -10, so a window with padding frames peaks at least there.
        peak = log.amax(dim=(1, 2), keepdim=True)  # [B, 1, 1]
        if log.shape[-1] < cfg.window_frames:
            peak = peak.clamp(min=-10.0)
        floor = peak - 8.0
        features = torch.empty(len(waveforms), cfg.n_mels, cfg.window_frames)
        features[..., : log.shape[-1]] = torch.maximum(log, floor)
        features[..., log.shape[-1] :] = floor.clamp(min=-10.0)  # silence, floored
        features = (features + 4.0) / 4.0
        return LogMel(features, [cfg.num_frames(len(w)) for w in waveforms])

    def clip_features(self, samples: np.ndarray) -> torch.Tensor:
        """A clip of any length -> its features [n_mels, len // hop_length], as transformers'
        extractor computes them unpadded (no truncation, padding "longest": its long-form
        generation's input) and openai-whisper over the whole clip: one transform over the
        clip, the -8 floor under the clip's peak, not a window's."""
        cfg = self.cfg
        wave = torch.as_tensor(samples, dtype=torch.float32)
        spec = torch.stft(wave, cfg.n_fft, cfg.hop_length, window=self.window,
                          return_complex=True)[..., :-1]  # [F, len // hop], centred frames
        log = (self.filters.T @ (spec.real.square() + spec.imag.square())).clamp(
            min=1e-10).log10()
        return (torch.maximum(log, log.max() - 8.0) + 4.0) / 4.0

    def window_of(self, clip: torch.Tensor, first_frame: int) -> torch.Tensor:
        """The window of a clip's features (`clip_features`) from frame `first_frame`:
        [n_mels, window_frames], zeros past the clip's end (transformers' long-form segment
        input)."""
        part = clip[:, first_frame:first_frame + self.cfg.window_frames]
        return torch.nn.functional.pad(part, (0, self.cfg.window_frames - part.shape[-1]))
