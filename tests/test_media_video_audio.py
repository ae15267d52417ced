"""A video's sound track decoded from the same source as its frames (``audio_sample_rate`` in
the video options): present, absent, not asked for, in-memory frames, refusals and limits."""

from __future__ import annotations

import functools
import io

import av
import numpy as np
import pytest

from engine.media import (
    MediaLimits,
    VideoFrames,
    load_audio_sync,
    load_request_media,
    load_request_media_sync,
    load_video,
    load_video_sync,
    loader,
)
from tests.media_fixtures import VideoSpec, encode_video, gradient, peak_frequency, refused

RATE = 16000


@functools.cache
def video(spec: VideoSpec | None = None) -> bytes:
    """Encoded once per spec; by default 20 grey frames, 64x48, 10 fps, 2 s, no sound."""
    return encode_video(spec or VideoSpec())


SOUND = VideoSpec(audio_rate=48000, audio_freq=1000)


def video_with_ac3_track() -> bytes:
    """A 1 s mp4 whose sound track is AC-3, a codec the decoders do not accept."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        sound = container.add_stream("ac3", rate=48000)
        for index in range(10):
            frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 99, np.uint8), "rgb24")
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
        size = sound.codec_context.frame_size
        for start in range(0, 48000, size):
            silence = av.AudioFrame.from_ndarray(
                np.zeros((2, size), np.float32), format="fltp", layout="stereo"
            )
            silence.sample_rate, silence.pts = 48000, start
            container.mux(sound.encode(silence))
        container.mux(sound.encode())
    return buffer.getvalue()


def assert_sound_track(result: VideoFrames, spec: VideoSpec) -> None:
    """The clip is mono float32 at RATE, as long as the video (AAC adds up to a frame or two
    of priming and padding) and carries the spec's tone."""
    assert result.has_audio_track is True
    clip = result.audio
    assert clip is not None
    assert clip.samples.dtype == np.float32 and clip.samples.ndim == 1
    assert clip.sample_rate == RATE
    assert result.duration_s == pytest.approx(spec.frames / spec.fps, abs=0.05)
    assert clip.duration_s == pytest.approx(result.duration_s, abs=2 * 1024 / spec.audio_rate)
    assert peak_frequency(clip.samples, RATE) == pytest.approx(spec.audio_freq, abs=5)
    assert 0.4 < np.abs(clip.samples).max() < 0.65


def no_sound_decoding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        loader, "decode_sound_track", lambda *a, **k: pytest.fail("no sound track was asked for")
    )


# Present ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec", [SOUND, VideoSpec(audio_rate=44100), VideoSpec(frames=15, fps=5, audio_rate=22050)]
)
def test_mp4_with_aac_track(spec: VideoSpec) -> None:
    data = video(spec)
    result = load_video_sync(data, fps=5, audio_sample_rate=RATE)
    frames_only = load_video_sync(data, fps=5)
    assert np.array_equal(result.frames, frames_only.frames)
    assert np.array_equal(result.timestamps, frames_only.timestamps)
    assert_sound_track(result, spec)


def test_through_the_request_loader() -> None:
    loaded = load_request_media_sync(
        {"video": [video(SOUND)]}, video_kwargs={"fps": 2, "audio_sample_rate": RATE}
    )
    result = loaded["video"][0]
    assert result.frames.shape == (4, 48, 64, 3)
    assert result.sampling.target_fps == 2
    assert_sound_track(result, SOUND)


async def test_async_fronts() -> None:
    assert_sound_track(await load_video(video(SOUND), audio_sample_rate=RATE), SOUND)
    loaded = await load_request_media(
        {"video": [video(), video(SOUND)]}, video_kwargs={"audio_sample_rate": RATE}
    )
    silent, sounding = loaded["video"]
    assert silent.has_audio_track is False and silent.audio is None
    assert_sound_track(sounding, SOUND)


def test_source_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[str] = []
    read_source = loader.read_source

    def counting(src, **kwargs):
        reads.append(kwargs["item"])
        return read_source(src, **kwargs)

    monkeypatch.setattr(loader, "read_source", counting)
    data = video(SOUND)
    # Exactly the item's bytes: a second read would pass the request's byte cap.
    limits = MediaLimits(max_request_bytes=len(data))
    loaded = load_request_media_sync(
        {"video": data}, limits=limits, video_kwargs={"audio_sample_rate": RATE}
    )
    assert_sound_track(loaded["video"][0], SOUND)
    assert reads == ["video 1"]


def test_decode_audio_of_a_video_still_works() -> None:
    clip = load_audio_sync(video(SOUND))
    assert clip.sample_rate == RATE
    assert peak_frequency(clip.samples, RATE) == pytest.approx(1000, abs=5)


# Absent or not asked for -----------------------------------------------------------------


def test_video_without_sound() -> None:
    result = load_video_sync(video(), fps=5, audio_sample_rate=RATE)
    assert result.has_audio_track is False and result.audio is None
    assert result.frames.shape == (10, 48, 64, 3)


def test_not_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    no_sound_decoding(monkeypatch)
    result = load_video_sync(video(SOUND), fps=5)
    assert result.has_audio_track is None and result.audio is None
    loaded = load_request_media_sync({"video": video(SOUND)}, video_kwargs={"fps": 2})
    assert loaded["video"][0].has_audio_track is None and loaded["video"][0].audio is None
    explicit = load_video_sync(video(SOUND), audio_sample_rate=None)
    assert explicit.has_audio_track is None


@pytest.mark.parametrize(
    "frames",
    [
        np.zeros((3, 8, 8, 3), np.uint8),
        [gradient(8, 8)] * 3,
        [np.zeros((8, 8, 3), np.uint8)] * 3,
        gradient(8, 8),
    ],
    ids=["array", "pil-list", "array-list", "pil"],
)
def test_in_memory_frames_have_no_sound_track(frames, monkeypatch: pytest.MonkeyPatch) -> None:
    no_sound_decoding(monkeypatch)
    result = load_video_sync(frames, audio_sample_rate=RATE)
    assert result.has_audio_track is False and result.audio is None
    assert load_video_sync(frames).has_audio_track is None
    loaded = load_request_media_sync({"video": [frames]}, video_kwargs={"audio_sample_rate": RATE})
    assert loaded["video"][0].has_audio_track is False


def test_in_memory_tensor_has_no_sound_track() -> None:
    torch = pytest.importorskip("torch")
    result = load_video_sync(torch.zeros(2, 3, 8, 8, dtype=torch.uint8), audio_sample_rate=RATE)
    assert result.has_audio_track is False and result.audio is None


# Refused ---------------------------------------------------------------------------------


def test_sound_track_longer_than_the_limit() -> None:
    limits = MediaLimits(max_audio_duration_s=1.0)
    message = refused(
        lambda: load_video_sync(video(SOUND), audio_sample_rate=RATE, limits=limits),
        "video 1: its sound track",
        "exceeds the limit of 1 s (MediaLimits.max_audio_duration_s)",
    )
    assert message.startswith("video 1: its sound track: duration")
    # Frames only: the audio limit does not apply.
    assert load_video_sync(video(SOUND), limits=limits).frames.shape[0] == 4
    refused(
        lambda: load_request_media_sync(
            {"video": [video(), video(SOUND)]},
            limits=limits,
            video_kwargs={"audio_sample_rate": RATE},
        ),
        "video 2: its sound track",
        "MediaLimits.max_audio_duration_s",
    )


def test_sound_track_in_a_refused_codec() -> None:
    if "ac3" not in av.codecs_available:
        pytest.skip("this FFmpeg build has no ac3 encoder")
    data = video_with_ac3_track()
    assert load_video_sync(data).frames.shape[0] == 2
    refused(
        lambda: load_video_sync(data, audio_sample_rate=RATE),
        "video 1: its sound track: the ac3 audio codec is not accepted",
    )


def test_sound_track_counts_against_the_decoded_budget() -> None:
    # 4 frames of 64x48 RGB fit; 2 s of float32 at 16 kHz (128 kB) do not.
    limits = MediaLimits(max_request_decoded_bytes=4 * 64 * 48 * 3 + 1000)
    assert load_video_sync(video(SOUND), fps=2, limits=limits).frames.shape[0] == 4
    refused(
        lambda: load_video_sync(video(SOUND), fps=2, audio_sample_rate=RATE, limits=limits),
        "video 1: its sound track",
        "MediaLimits.max_request_decoded_bytes",
    )


@pytest.mark.parametrize("rate", [0, 10**9, "x", 16000.0, True])
def test_bad_audio_sample_rate(rate: object, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "read_source", lambda *a, **k: pytest.fail("nothing may load"))
    refused(
        lambda: load_video_sync(video(SOUND), audio_sample_rate=rate),
        "video 1: requested audio sample rate",
        "MediaLimits.min_audio_sample_rate/max_audio_sample_rate",
    )
    refused(
        lambda: load_request_media_sync(
            {"video": [video(SOUND)]}, video_kwargs={"fps": 2, "audio_sample_rate": rate}
        ),
        "video 1: requested audio sample rate",
    )


def test_unknown_video_option_is_still_refused() -> None:
    with pytest.raises(TypeError):
        load_request_media_sync({"video": video()}, video_kwargs={"audio_rate": RATE})
