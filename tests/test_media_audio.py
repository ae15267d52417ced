"""Audio decoding: formats through libsndfile and FFmpeg, downmix and resampling, in-memory
waveforms and refused inputs."""

from __future__ import annotations

import av
import numpy as np
import pytest

from engine.media import AudioClip, MediaLimits, load_audio_sync
from tests.media_fixtures import (
    VideoSpec,
    encode_av_audio,
    encode_soundfile,
    encode_video,
    peak_frequency,
    refused,
    tone,
)

GOOD_WAV = encode_soundfile(tone(1000, 16000, 0.5), 16000, "WAV")


def assert_tone(clip: AudioClip, freq: float, seconds: float, rate: int = 16000) -> None:
    assert clip.samples.dtype == np.float32 and clip.samples.ndim == 1
    assert clip.sample_rate == rate
    # Lossy codecs add a few ms of encoder delay and padding.
    assert clip.duration_s == pytest.approx(seconds, abs=0.08)
    assert peak_frequency(clip.samples, rate) == pytest.approx(freq, abs=5)
    assert 0.4 < np.abs(clip.samples).max() < 0.65


def assert_loader_still_works() -> None:
    assert_tone(load_audio_sync(GOOD_WAV), 1000, 0.5)


@pytest.mark.parametrize(("rate", "channels"), [(8000, 1), (44100, 2), (48000, 2)])
@pytest.mark.parametrize(("fmt", "subtype"), [("WAV", "PCM_16"), ("FLAC", None), ("OGG", None)])
def test_soundfile_formats_resample_to_16k_mono(
    rate: int, channels: int, fmt: str, subtype: str | None
) -> None:
    data = encode_soundfile(tone(1000, rate, 1.0, channels), rate, fmt, subtype)
    clip = load_audio_sync(data)
    assert len(clip.samples) == pytest.approx(16000, abs=1)
    assert_tone(clip, 1000, 1.0)


@pytest.mark.parametrize(
    ("fmt", "codec", "rate"),
    [
        ("mp3", "libmp3lame", 44100),
        ("mp4", "aac", 48000),  # .m4a
        ("webm", "libopus", 48000),
    ],
)
def test_ffmpeg_formats(fmt: str, codec: str, rate: int) -> None:
    if codec not in av.codecs_available:
        pytest.skip(f"this FFmpeg build has no {codec} encoder")
    clip = load_audio_sync(encode_av_audio(tone(1000, rate, 1.0, 2), rate, fmt, codec))
    assert_tone(clip, 1000, 1.0)


def test_audio_track_of_a_video() -> None:
    data = encode_video(VideoSpec(frames=10, fps=10, audio_rate=44100))
    assert_tone(load_audio_sync(data), 440, 1.0)


def test_other_output_rate() -> None:
    clip = load_audio_sync(GOOD_WAV, sample_rate=8000)
    assert len(clip.samples) == 4000
    assert_tone(clip, 1000, 0.5, rate=8000)


def test_stereo_is_averaged_to_mono() -> None:
    left_only = np.stack([tone(1000, 16000, 0.5), np.zeros(8000, np.float32)], axis=1)
    clip = load_audio_sync(encode_soundfile(left_only, 16000, "WAV", "FLOAT"))
    assert np.abs(clip.samples).max() == pytest.approx(0.25, abs=0.01)


def test_silence_is_valid() -> None:
    clip = load_audio_sync(encode_soundfile(np.zeros(16000, np.float32), 16000, "WAV"))
    assert len(clip.samples) == 16000 and not clip.samples.any()


def test_zero_length_audio() -> None:
    empty = encode_soundfile(np.zeros(0, np.float32), 16000, "WAV")
    refused(lambda: load_audio_sync(empty), "audio 1: the audio contains no samples")
    assert_loader_still_works()


@pytest.mark.parametrize("rate", [10_000_000, 100])
def test_absurd_sample_rate(rate: int) -> None:
    data = bytearray(encode_soundfile(tone(440, 16000, 0.1), 16000, "WAV"))
    data[24:28] = rate.to_bytes(4, "little")  # the fmt chunk's sample rate field
    refused(
        lambda: load_audio_sync(bytes(data)),
        f"audio 1: sample rate {rate} Hz is outside the allowed range 1000-384000 Hz",
    )
    assert_loader_still_works()


def test_too_long_audio() -> None:
    refused(
        lambda: load_audio_sync(GOOD_WAV, limits=MediaLimits(max_audio_duration_s=0.25)),
        "audio 1: duration 0.5 s exceeds the limit of 0.25 s (MediaLimits.max_audio_duration_s)",
    )
    assert_loader_still_works()


def test_video_without_audio() -> None:
    refused(
        lambda: load_audio_sync(encode_video(VideoSpec(frames=5)), item="audio 4"),
        "audio 4: the file contains no audio stream",
    )
    assert_loader_still_works()


@pytest.mark.parametrize(
    "data",
    [b"", b"RIFF\x00\x00\x00\x00WAVEjunk", np.random.default_rng(5).bytes(5000)],
    ids=["empty", "broken-header", "random"],
)
def test_undecodable_audio(data: bytes) -> None:
    refused(lambda: load_audio_sync(data), "audio 1: could not decode the audio")
    assert_loader_still_works()


def test_bad_requested_rate() -> None:
    refused(
        lambda: load_audio_sync(GOOD_WAV, sample_rate=50),
        "audio 1: requested sample rate 50 Hz is outside the allowed range",
    )


def test_waveform_tuples() -> None:
    mono = tone(1000, 22050, 1.0)
    stereo = np.stack([mono, mono])
    int16 = (mono * 32767).astype(np.int16)
    for waveform in (mono, stereo, stereo.T, int16):
        assert_tone(load_audio_sync((waveform, 22050)), 1000, 1.0)
    same_rate = load_audio_sync((tone(1000, 16000, 0.5), 16000))
    assert np.allclose(same_rate.samples, tone(1000, 16000, 0.5), atol=1e-6)


def test_torch_waveform() -> None:
    torch = pytest.importorskip("torch")
    waveform = torch.from_numpy(tone(1000, 48000, 0.5, channels=2).T.copy())
    assert_tone(load_audio_sync((waveform, 48000)), 1000, 0.5)


def test_bad_waveforms() -> None:
    refused(lambda: load_audio_sync((tone(440, 16000, 0.1), 10)), "audio 1: source sample rate")
    refused(lambda: load_audio_sync((np.zeros(0, np.float32), 16000)), "contains no samples")
    refused(lambda: load_audio_sync((np.zeros((2, 2, 2)), 16000)), "waveforms must be shaped")
    refused(lambda: load_audio_sync((np.array([np.nan]), 16000)), "NaN or infinite")
    refused(lambda: load_audio_sync((1, 2, 3)), "(waveform, sample_rate) tuple")
    assert_loader_still_works()
