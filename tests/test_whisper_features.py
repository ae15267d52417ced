"""Our log-mel features against transformers' WhisperFeatureExtractor: the filterbank, the
features and the frame mask for several lengths, silence, a tone, noise and batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor

from models.processing.log_mel import LogMelExtractor, MelConfig, slaney_mel_filters
from tests.media_fixtures import tone


def reference(cfg: MelConfig) -> WhisperFeatureExtractor:
    return WhisperFeatureExtractor(
        feature_size=cfg.n_mels, sampling_rate=cfg.sample_rate, hop_length=cfg.hop_length,
        chunk_length=cfg.chunk_length, n_fft=cfg.n_fft,
    )


def assert_matches(cfg: MelConfig, waveforms: list[np.ndarray]) -> None:
    ref = reference(cfg)(waveforms, sampling_rate=cfg.sample_rate, return_attention_mask=True,
                         padding="max_length", return_tensors="pt")
    ours = LogMelExtractor(cfg)(waveforms)
    assert ours.features.shape == ref["input_features"].shape
    torch.testing.assert_close(ours.features, ref["input_features"], atol=1e-4, rtol=0)
    assert torch.equal(ours.mask, ref["attention_mask"].int())
    assert ours.num_frames == ref["attention_mask"].sum(-1).tolist()


def noise(samples: int, seed: int, scale: float = 0.3) -> np.ndarray:
    return (scale * np.random.default_rng(seed).standard_normal(samples)).astype(np.float32)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_filterbank_matches(n_mels):
    ours = slaney_mel_filters(201, n_mels, 16000)  # n_fft 400
    ref = reference(MelConfig(n_mels=n_mels)).mel_filters
    np.testing.assert_allclose(ours.numpy(), ref, atol=1e-7, rtol=0)


# Around frame boundaries (hop 160), tiny, and up to the full 30 s window.
LENGTHS = [1, 159, 160, 161, 321, 12_345, 16_000 * 29 + 7, 479_999, 480_000]


@pytest.mark.parametrize("n_mels", [80, 128])
@pytest.mark.parametrize("samples", LENGTHS)
def test_noise_of_many_lengths(n_mels, samples):
    assert_matches(MelConfig(n_mels=n_mels), [noise(samples, samples)])


@pytest.mark.parametrize("samples", [1, 8000, 480_000])
def test_silence(samples):
    assert_matches(MelConfig(n_mels=128), [np.zeros(samples, np.float32)])


def test_tone_and_near_silence():
    assert_matches(MelConfig(n_mels=128), [tone(440, 16000, 2.0), noise(5000, 3, scale=1e-6)])


def test_batch_of_mixed_lengths_equals_one_by_one():
    cfg = MelConfig(n_mels=128)
    clips = [noise(n, i) for i, n in enumerate((400, 480_000, 33_333, 161))] + [
        tone(1000, 16000, 10.0), np.zeros(1600, np.float32)]
    assert_matches(cfg, clips)
    batch = LogMelExtractor(cfg)(clips)
    for i, clip in enumerate(clips):
        alone = LogMelExtractor(cfg)([clip])
        torch.testing.assert_close(batch.features[i], alone.features[0], atol=1e-5, rtol=0)
        assert batch.num_frames[i] == alone.num_frames[0]


def test_other_window_fft_and_hop():
    cfg = MelConfig(n_mels=80, n_fft=512, hop_length=128, chunk_length=10)
    assert_matches(cfg, [noise(16000 * 3, 4), noise(160_000, 5), noise(129, 6)])


def test_waveform_longer_than_the_window_is_refused():
    with pytest.raises(ValueError, match="exceeds one 30 s window.*split it first"):
        LogMelExtractor(MelConfig())([np.zeros(480_001, np.float32)])


def test_config_from_a_preprocessor_config():
    cfg = MelConfig.from_preprocessor({"feature_size": 128, "sampling_rate": 16000,
                                       "hop_length": 160, "chunk_length": 30, "n_fft": 400})
    assert cfg == MelConfig(n_mels=128)
    assert (cfg.window_samples, cfg.window_frames) == (480_000, 3000)
    assert MelConfig.from_preprocessor(None).n_mels == 80  # WhisperFeatureExtractor's default
