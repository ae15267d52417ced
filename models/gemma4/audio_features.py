"""Gemma 4's audio features (what transformers' Gemma4AudioFeatureExtractor computes) and the
embeddings a clip becomes.

A clip (mono, at `sampling_rate`) is zero-padded at the end to a multiple of 128 samples, and by
half a frame at the start (each frame centred at its time); frames of `frame_length_ms` every
`hop_length_ms` are windowed (periodic Hann), transformed (an FFT of the next power of two),
their magnitudes projected onto an HTK mel filterbank (no normalization), `log(mel + floor)`
taken and optionally normalized per bin. A frame is real only when all its samples are the
clip's; the others are zeroed. The encoder halves the frames twice (every other one is kept as
real), so a clip of F real frames gives ceil(ceil(F / 2) / 2) embeddings.

Clips past 30 s (the extractor's `max_length` of 480000 samples, which it truncates to) are
refused by the processor rather than cut.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from models.checkpoint import Schema, Settings

PAD_MULTIPLE = 128  # the extractor's pad_to_multiple_of
MAX_SAMPLES = 480_000  # its max_length (truncation above it)

# transformers' Gemma4AudioFeatureExtractor and its defaults. `frame_length`, `hop_length`,
# `fft_length` and `mel_filters` (which its to_dict writes) are recomputed from the settings;
# `dither` adds random noise (only 0 is reproducible).
FEATURE_EXTRACTOR = Schema("Gemma4AudioFeatureExtractor", {
    "feature_size": 128, "sampling_rate": 16000, "frame_length_ms": 20.0, "hop_length_ms": 10.0,
    "min_frequency": 0.0, "max_frequency": 8000.0, "preemphasis": 0.0,
    "preemphasis_htk_flavor": True, "fft_overdrive": False, "input_scale_factor": 1.0,
    "mel_floor": 1e-3, "per_bin_mean": None, "per_bin_stddev": None,
}, fixed={"dither": 0.0, "padding_value": 0.0},
    inert=frozenset({"frame_length", "hop_length", "fft_length", "mel_filters"}))


@dataclass(frozen=True)
class AudioFeatureConfig:
    n_mels: int
    sample_rate: int
    frame_length: int  # samples
    hop_length: int
    fft_length: int
    min_frequency: float
    max_frequency: float
    preemphasis: float
    htk_preemphasis: bool
    input_scale: float
    mel_floor: float
    per_bin_mean: tuple[float, ...] | None
    per_bin_stddev: tuple[float, ...] | None

    @classmethod
    def from_settings(cls, s: Settings) -> AudioFeatureConfig:
        rate = int(s["sampling_rate"])
        frame = int(round(rate * float(s["frame_length_ms"]) / 1000.0))
        fft = 2 ** math.ceil(math.log2(frame)) * (2 if s["fft_overdrive"] else 1)

        def per_bin(key: str) -> tuple[float, ...] | None:
            value = s[key]
            return None if value is None else tuple(float(v) for v in np.ravel(value))

        return cls(int(s["feature_size"]), rate, frame,
                   int(round(rate * float(s["hop_length_ms"]) / 1000.0)), fft,
                   float(s["min_frequency"]), float(s["max_frequency"]), float(s["preemphasis"]),
                   bool(s["preemphasis_htk_flavor"]), float(s["input_scale_factor"]),
                   float(np.ravel(s["mel_floor"])[0]), per_bin("per_bin_mean"),
                   per_bin("per_bin_stddev"))

    def num_frames(self, num_samples: int) -> int:
        """Frames of the clip once padded (real or not)."""
        padded = -(-num_samples // PAD_MULTIPLE) * PAD_MULTIPLE + self.frame_length // 2
        return max((padded - self.frame_length - 1) // self.hop_length + 1, 0)

    def num_embeds(self, num_samples: int) -> int:
        """Embeddings of a clip: its real frames' mask halved twice (every other kept)."""
        real = _real_mask(self, num_samples)
        for _ in range(2):
            real = real[::2]
        return int(real.sum())


def _real_mask(cfg: AudioFeatureConfig, num_samples: int) -> np.ndarray:
    """[frames] bool: whether each frame of the padded clip holds only real samples."""
    frames = cfg.num_frames(num_samples)
    last = np.arange(frames) * cfg.hop_length + cfg.frame_length  # its last sample, padded
    return last < num_samples + cfg.frame_length // 2


def htk_mel_filters(n_freqs: int, n_mels: int, rate: int, f_min: float,
                    f_max: float) -> np.ndarray:
    """Triangular filters [n_freqs, n_mels] (float64), evenly spaced on the HTK mel scale, not
    normalized."""
    def to_mel(hz):
        return 2595.0 * np.log10(1.0 + hz / 700.0)

    mels = np.linspace(to_mel(f_min), to_mel(f_max), n_mels + 2)
    edges = 700.0 * (10.0 ** (mels / 2595.0) - 1.0)
    freqs = np.linspace(0, rate // 2, n_freqs)
    slopes = edges[None, :] - freqs[:, None]
    widths = np.diff(edges)
    falling = -slopes[:, :-2] / widths[:-1]
    rising = slopes[:, 2:] / widths[1:]
    return np.maximum(0.0, np.minimum(falling, rising))


class AudioFeatures:
    """One clip -> {"input_features" [frames, n_mels] float32 (padding frames zero),
    "mask" [frames] bool}; the filterbank and window are built once."""

    def __init__(self, cfg: AudioFeatureConfig) -> None:
        self.cfg = cfg
        n = cfg.frame_length
        self.window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(n) / n)).astype(np.float32)
        self.filters = htk_mel_filters(cfg.fft_length // 2 + 1, cfg.n_mels, cfg.sample_rate,
                                       cfg.min_frequency, cfg.max_frequency)

    def __call__(self, samples: np.ndarray) -> dict:
        cfg = self.cfg
        wave = np.asarray(samples, dtype=np.float32)
        padded = -(-len(wave) // PAD_MULTIPLE) * PAD_MULTIPLE
        wave = np.pad(wave, (cfg.frame_length // 2, padded - len(wave)))
        if cfg.input_scale != 1.0:
            wave = wave * cfg.input_scale
        size, frames = cfg.frame_length + 1, cfg.num_frames(len(samples))
        index = np.arange(frames)[:, None] * cfg.hop_length + np.arange(size)[None, :]
        chunks = wave[index]  # [frames, frame_length + 1]
        if cfg.preemphasis > 0.0:
            p = cfg.preemphasis
            if cfg.htk_preemphasis:
                chunks = np.concatenate([chunks[:, :1] * (1.0 - p),
                                         chunks[:, 1:-1] - p * chunks[:, :-2]], axis=-1)
            else:
                chunks = chunks[:, 1:] - p * chunks[:, :-1]
        else:
            chunks = chunks[:, :-1]
        spectrum = np.abs(np.fft.rfft(chunks * self.window, n=cfg.fft_length, axis=-1))
        log_mel = np.log(spectrum @ self.filters + np.float64(cfg.mel_floor))
        if cfg.per_bin_mean is not None:
            log_mel = log_mel - np.asarray(cfg.per_bin_mean)
        if cfg.per_bin_stddev is not None:
            log_mel = log_mel / np.asarray(cfg.per_bin_stddev)
        mask = _real_mask(cfg, len(samples))
        features = log_mel.astype(np.float32) * mask[:, None]
        return {"input_features": torch.from_numpy(features), "mask": torch.from_numpy(mask)}
