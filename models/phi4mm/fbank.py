"""Phi-4-multimodal's audio features: what transformers' Phi4MultimodalFeatureExtractor computes
for one clip.

Frames of `win_length` samples every `hop_length` (only whole frames: a clip of L samples has
(L - win_length) // hop_length + 1), each pre-emphasised within itself (its first sample
against itself) and scaled to 16-bit range, windowed by a symmetric Hamming window, transformed
by an `n_fft`-point real FFT (the window product and the FFT in float64, the spectrum rounded to
complex64), squared, projected on a Kaldi-scale mel filterbank triangular in mel space between
`mel_min_frequency` and `mel_max_frequency` (no area normalisation), floored at 1 and logged.
The encoder turns every `audio_compression_rate` frames into one embedding (the last group may
be partial).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from models.checkpoint import Schema, Settings

# transformers' Phi4MultimodalFeatureExtractor with its own defaults. `audio_downsample_rate`
# and `audio_feat_stride` other than 1 change the counts in ways the model (which reads its
# own audio_config) does not follow: refused.
FEATURE_EXTRACTOR = Schema("Phi4MultimodalFeatureExtractor", {
    "feature_size": 80, "sampling_rate": 16000, "hop_length": 160, "n_fft": 512,
    "win_length": 400, "preemphasis": 0.97, "audio_compression_rate": 8,
    "mel_min_frequency": 0.0, "mel_max_frequency": 7690.0,
}, fixed={"audio_downsample_rate": 1, "audio_feat_stride": 1})


@dataclass(frozen=True)
class FbankConfig:
    n_mels: int = 80
    sample_rate: int = 16000
    hop_length: int = 160
    n_fft: int = 512
    win_length: int = 400
    preemphasis: float = 0.97
    compression: int = 8
    f_min: float = 0.0
    f_max: float = 7690.0

    @classmethod
    def from_settings(cls, s: Settings) -> FbankConfig:
        return cls(int(s["feature_size"]), int(s["sampling_rate"]), int(s["hop_length"]),
                   int(s["n_fft"]), int(s["win_length"]), float(s["preemphasis"]),
                   int(s["audio_compression_rate"]), float(s["mel_min_frequency"]),
                   float(s["mel_max_frequency"]))

    def num_frames(self, num_samples: int) -> int:
        """Whole frames of a clip (0 when it is shorter than one window)."""
        if num_samples < self.win_length:
            return 0
        return (num_samples - self.win_length) // self.hop_length + 1

    def num_embeds(self, num_samples: int) -> int:
        """The clip's audio tokens: its frames in groups of `compression`, rounded up."""
        return -(-self.num_frames(num_samples) // self.compression)


def _kaldi_mel(hz: np.ndarray | float) -> np.ndarray:
    return 1127.0 * np.log(1.0 + np.asarray(hz, dtype=np.float64) / 700.0)


def kaldi_mel_filters(cfg: FbankConfig) -> np.ndarray:
    """Triangular filters float64 [n_fft / 2 + 1, n_mels], evenly spaced and triangular on the
    Kaldi mel scale (1127 ln(1 + f / 700)), unnormalised."""
    bins = cfg.n_fft // 2 + 1
    edges = np.linspace(_kaldi_mel(cfg.f_min), _kaldi_mel(cfg.f_max), cfg.n_mels + 2)
    freqs = _kaldi_mel(cfg.sample_rate / ((bins - 1) * 2) * np.arange(bins))
    width = np.diff(edges)
    offset = edges[None, :] - freqs[:, None]  # [bins, n_mels + 2]
    rising = -offset[:, :-2] / width[:-1]
    falling = offset[:, 2:] / width[1:]
    return np.maximum(0.0, np.minimum(rising, falling))


class FbankExtractor:
    """Log-mel features of single clips; the window and filterbank are built once."""

    def __init__(self, cfg: FbankConfig) -> None:
        self.cfg = cfg
        self.window = torch.hamming_window(cfg.win_length, periodic=False, dtype=torch.float64)
        self.filters = torch.from_numpy(kaldi_mel_filters(cfg)).float()

    def __call__(self, samples: np.ndarray) -> torch.Tensor:
        """float32 samples [L] at the extractor's rate -> features float32 [frames, n_mels]."""
        cfg = self.cfg
        wave = torch.as_tensor(samples, dtype=torch.float32)
        frames = wave.unfold(0, cfg.win_length, cfg.hop_length)  # [T, win]
        previous = torch.roll(frames, 1, dims=-1)
        previous[:, 0] = previous[:, 1]
        frames = (frames - cfg.preemphasis * previous) * 32768
        spectrum = torch.fft.rfft(self.window * frames, n=cfg.n_fft, dim=1).to(torch.complex64)
        power = spectrum.abs() ** 2
        return torch.clamp(power @ self.filters, min=1.0).log()
