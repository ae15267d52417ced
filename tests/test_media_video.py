"""Video decoding: containers and codecs, frame sampling by seeking, timestamps, rotation,
in-memory frames and refused inputs."""

from __future__ import annotations

import functools

import av
import numpy as np
import pytest
from PIL import Image

from engine.media import MediaLimits, VideoFrames, load_video_sync
from engine.media.orientation import upright
from tests.media_fixtures import (
    VideoSpec,
    encode_soundfile,
    encode_video,
    level,
    refused,
    tone,
)


@functools.cache
def video(spec: VideoSpec | None = None) -> bytes:
    """Encoded once per spec; by default 20 grey frames, 64x48, 10 fps, 2 s."""
    return encode_video(spec or VideoSpec())


def levels(result: VideoFrames) -> np.ndarray:
    return result.frames.mean(axis=(1, 2, 3))


def assert_frames_match_timestamps(result: VideoFrames, fps: int) -> None:
    """Each frame shows the grey level encoded for the source frame at its timestamp."""
    expected = [level(round(t * fps)) for t in result.timestamps]
    assert np.abs(levels(result) - expected).max() < 8


def assert_loader_still_works() -> None:
    result = load_video_sync(video(), fps=5)
    assert result.frames.shape == (10, 48, 64, 3)


def needs_codec(name: str) -> None:
    if name not in av.codecs_available:
        pytest.skip(f"this FFmpeg build has no {name} encoder")


@pytest.mark.parametrize(
    ("fmt", "codec"),
    [
        ("mp4", "libx264"),
        ("mp4", "mpeg4"),
        ("webm", "libvpx"),
        ("webm", "libvpx-vp9"),
        ("gif", "gif"),
    ],
)
def test_containers_and_codecs(fmt: str, codec: str) -> None:
    needs_codec(codec)
    result = load_video_sync(video(VideoSpec(fmt=fmt, codec=codec)), fps=5)
    assert result.frames.dtype == np.uint8 and result.frames.shape == (10, 48, 64, 3)
    assert result.timestamps.dtype == np.float64
    assert result.duration_s == pytest.approx(2.0, abs=0.05)
    assert result.source_fps == pytest.approx(10)
    assert result.source_frame_count == 20
    assert result.sampled_fps == pytest.approx(5, rel=0.05)
    assert np.allclose(np.diff(result.timestamps), 0.2, atol=1e-3)
    assert 0 <= result.timestamps[0] and result.timestamps[-1] < result.duration_s
    assert_frames_match_timestamps(result, 10)


def test_sampling_record() -> None:
    result = load_video_sync(video(), fps=2.5, min_frames=2, max_frames=9)
    assert (result.sampling.target_fps, result.sampling.min_frames) == (2.5, 2)
    assert result.sampling.max_frames == 9
    assert load_video_sync(video()).sampling.max_frames == MediaLimits().max_video_frames


@pytest.mark.parametrize(
    ("kwargs", "count"),
    [
        ({"fps": 2}, 4),
        ({"fps": 2, "min_frames": 8}, 8),
        ({"fps": 5, "max_frames": 3}, 3),
        ({"fps": 100}, 20),  # no more frames than the video has
        ({"fps": 0.01}, 1),
        ({"fps": 1, "min_frames": 30}, 30),  # a too-short video repeats frames
    ],
)
def test_frame_count_is_clamped(kwargs: dict, count: int) -> None:
    result = load_video_sync(video(), **kwargs)
    assert result.frames.shape[0] == len(result.timestamps) == count
    assert np.all(np.diff(result.timestamps) >= 0)
    assert result.timestamps[-1] < result.duration_s
    assert_frames_match_timestamps(result, 10)


def test_max_video_frames_limit_bounds_max_frames() -> None:
    limits = MediaLimits(max_video_frames=5)
    result = load_video_sync(video(), fps=10, limits=limits)
    assert result.frames.shape[0] == 5 and result.sampling.max_frames == 5
    at_limit = load_video_sync(video(), fps=10, max_frames=5, limits=limits)
    assert at_limit.frames.shape[0] == 5
    refused(
        lambda: load_video_sync(video(), fps=10, max_frames=6, limits=limits),
        "video 1: max_frames=6 must be an integer between 1 and 5 (MediaLimits.max_video_frames)",
    )


@pytest.mark.parametrize("bframes", [0, 3])
def test_sparse_samples_seek_instead_of_decoding_everything(bframes: int) -> None:
    long_video = video(VideoSpec(frames=600, fps=10, gop=10, bframes=bframes))
    result = load_video_sync(long_video, fps=4 / 60)
    assert result.timestamps.tolist() == pytest.approx([0, 15, 30, 45])
    assert result.source_frame_count == 600
    # Each sample costs about one keyframe interval (10 frames) of decoding, plus the
    # reordering delay with B-frames.
    assert result.decoded_frames <= 4 * (10 + bframes)
    assert_frames_match_timestamps(result, 10)


def test_b_frames_in_display_order() -> None:
    result = load_video_sync(video(VideoSpec(frames=60, gop=30, bframes=3)), fps=3)
    assert np.all(np.diff(result.timestamps) > 0)
    assert_frames_match_timestamps(result, 10)


def test_close_samples_decode_forward_without_going_back() -> None:
    result = load_video_sync(video(VideoSpec(frames=40, gop=10)), fps=5)
    assert result.frames.shape[0] == 20
    # Every frame up to the last sample decoded at most once: no re-seek backwards.
    assert result.decoded_frames <= 39
    assert_frames_match_timestamps(result, 10)


def test_variable_frame_rate_uses_real_timestamps() -> None:
    pts_ms = [0, 100, 150, 500, 550, 1000, 1900, 2000, 2050, 2900]
    result = load_video_sync(video(VideoSpec(frames=10, pts_ms=tuple(pts_ms))), fps=3)
    times = np.array(pts_ms) / 1000
    count = len(result.timestamps)
    targets = np.arange(count) * result.duration_s / count
    # Each sample is the first frame at or after its evenly spaced target.
    expected = [times[min(np.searchsorted(times, t - 1e-6), len(times) - 1)] for t in targets]
    assert result.timestamps == pytest.approx(expected)
    expected_levels = [level(pts_ms.index(round(t * 1000))) for t in result.timestamps]
    assert np.abs(levels(result) - expected_levels).max() < 8


def marked_frame(index: int) -> np.ndarray:
    """64x32 grey frame with a red block in its top-left corner."""
    frame = np.full((32, 64, 3), 128, np.uint8)
    frame[:16, :16] = (255, 0, 0)
    return frame


def red_corner(frame: np.ndarray) -> str:
    height, width = frame.shape[:2]
    corners = {
        "top-left": frame[4, 4],
        "top-right": frame[4, width - 5],
        "bottom-left": frame[height - 5, 4],
        "bottom-right": frame[height - 5, width - 5],
    }
    reds = [name for name, p in corners.items() if p[0] > 200 and p[1] < 80]
    assert len(reds) == 1, corners
    return reds[0]


@pytest.mark.parametrize(
    ("rotation", "hflip", "shape", "corner"),
    [
        (None, False, (32, 64), "top-left"),
        (90, False, (64, 32), "bottom-left"),  # counter-clockwise, as PyAV and FFmpeg define
        (-90, False, (64, 32), "top-right"),
        (180, False, (32, 64), "bottom-right"),
        (0, True, (32, 64), "top-right"),
    ],
)
def test_display_matrix_rotation(rotation: int | None, hflip: bool, shape, corner: str) -> None:
    spec = VideoSpec(
        frames=4, width=64, height=32, rotation=rotation, hflip=hflip, pattern=marked_frame
    )
    result = load_video_sync(video(spec), fps=2)
    assert result.frames.shape[1:3] == shape
    assert all(red_corner(frame) == corner for frame in result.frames)


def test_upright_on_arrays() -> None:
    frame = np.arange(6).reshape(2, 3, 1)
    # FFmpeg's matrix for a 90° counter-clockwise rotation (16.16 fixed point).
    ccw = [0, -65536, 0, 65536, 0, 0, 0, 0, 1 << 30]
    assert upright(frame, ccw)[..., 0].tolist() == np.rot90(frame[..., 0]).tolist()
    assert upright(frame, None) is frame


def test_video_with_an_audio_track() -> None:
    result = load_video_sync(video(VideoSpec(audio_rate=44100)), fps=5)
    assert result.frames.shape == (10, 48, 64, 3)
    assert_frames_match_timestamps(result, 10)


def test_unseekable_raw_stream_is_decoded_forward() -> None:
    result = load_video_sync(video(VideoSpec(fmt="h264")), fps=5)
    # A raw H.264 stream carries no timing; FFmpeg assumes 25 fps.
    assert result.source_frame_count == 20 and result.frames.shape[0] >= 4
    assert levels(result)[0] == pytest.approx(level(0), abs=8)


def test_total_pixel_budget_downscales() -> None:
    limits = MediaLimits(max_video_total_pixels=10 * 32 * 24)
    result = load_video_sync(video(), fps=5, limits=limits)
    assert result.frames.shape == (10, 24, 32, 3)
    assert_frames_match_timestamps(result, 10)


def test_too_long_video() -> None:
    refused(
        lambda: load_video_sync(video(), limits=MediaLimits(max_video_duration_s=1.5)),
        "video 1: duration 2.0 s exceeds the limit of 1.5 s (MediaLimits.max_video_duration_s)",
    )
    assert_loader_still_works()


def test_too_large_frames() -> None:
    refused(
        lambda: load_video_sync(video(), limits=MediaLimits(max_video_frame_pixels=1000)),
        "video 1: frame size 64x48 exceeds the limit of 1000 pixels",
        "(MediaLimits.max_video_frame_pixels)",
    )
    assert_loader_still_works()


def test_audio_only_file_has_no_video_stream() -> None:
    wav = encode_soundfile(tone(440, 16000, 0.5), 16000, "WAV")
    refused(lambda: load_video_sync(wav, item="video 2"), "video 2: the file contains no video")
    assert_loader_still_works()


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda data: data[: len(data) // 2], id="truncated"),
        pytest.param(lambda data: np.random.default_rng(3).bytes(len(data)), id="random"),
        pytest.param(lambda data: b"", id="empty"),
    ],
)
def test_corrupted_video(damage) -> None:
    refused(lambda: load_video_sync(damage(video())), "video 1: could not decode the video")
    assert_loader_still_works()


def test_concat_script_cannot_read_other_files(tmp_path, monkeypatch) -> None:
    # FFmpeg's concat demuxer would open "clip.mp4" relative to the working directory.
    (tmp_path / "clip.mp4").write_bytes(video())
    monkeypatch.chdir(tmp_path)
    script = b"ffconcat version 1.0\nfile clip.mp4\n"
    refused(
        lambda: load_video_sync(script),
        "video 1: the data looks like ffconcat script, a format that is not accepted for video",
    )
    assert_loader_still_works()


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"fps": 0}, "fps must be a finite number > 0"),
        ({"fps": float("nan")}, "fps must be a finite number > 0"),
        ({"min_frames": 0}, "min_frames=0 must be between 1 and 768"),
        ({"min_frames": 5, "max_frames": 4}, "min_frames=5 must be between 1 and 4"),
    ],
)
def test_bad_sampling_arguments(kwargs: dict, fragment: str) -> None:
    refused(lambda: load_video_sync(video(), **kwargs), "video 1: " + fragment)


def test_in_memory_frames_play_at_the_requested_fps() -> None:
    frames = np.stack([np.full((6, 8, 3), level(i), np.uint8) for i in range(6)])
    for given in (frames, frames.transpose(0, 3, 1, 2), [Image.fromarray(f) for f in frames]):
        result = load_video_sync(given, fps=2)
        assert np.array_equal(result.frames, frames)
        assert result.timestamps.tolist() == [0, 0.5, 1, 1.5, 2, 2.5]
        assert (result.source_frame_count, result.duration_s) == (6, 3.0)
    fewer = load_video_sync(frames, fps=2, max_frames=3)
    assert fewer.timestamps.tolist() == [0, 1, 2]
    assert np.array_equal(fewer.frames, frames[[0, 2, 4]])


def test_in_memory_torch_frames() -> None:
    torch = pytest.importorskip("torch")
    frames = np.random.default_rng(4).integers(0, 256, (3, 3, 5, 7), dtype=np.uint8)
    result = load_video_sync(torch.from_numpy(frames), fps=1)
    assert np.array_equal(result.frames, frames.transpose(0, 2, 3, 1))


def test_bad_in_memory_frames() -> None:
    mixed = [np.zeros((4, 4, 3), np.uint8), np.zeros((5, 4, 3), np.uint8)]
    refused(lambda: load_video_sync(mixed), "video 1: all frames must have the same size")
    refused(lambda: load_video_sync(np.zeros((2, 4, 4), np.uint8)), "video 1: frames must be")
    refused(lambda: load_video_sync([]), "video 1: the frame list is empty")
    assert_loader_still_works()
