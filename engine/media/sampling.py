"""How a video's frames are chosen: the caller's validated sampling request (rate, frame
bounds, spread) and the times it picks from a video's duration and frame count."""

from __future__ import annotations

import math
import numbers

import numpy as np

from engine.media.limits import MediaError, MediaLimits
from models.media_inputs import MAX_FPS, VideoSampling

DEFAULT_FPS = 2.0
SPREADS = ("uniform", "frame_linspace", "segment_centers", "whole_seconds")


def video_sampling(
    *,
    fps: float = DEFAULT_FPS,
    min_frames: int = 1,
    max_frames: int | None = None,
    spread: str = "uniform",
    limits: MediaLimits,
    item: str,
) -> VideoSampling:
    """Validate the caller's sampling request; ``max_frames`` defaults to the limit, and a
    value above it is refused."""
    if (
        isinstance(fps, bool)
        or not isinstance(fps, numbers.Real)
        or not math.isfinite(fps)
        or not 0 < fps <= MAX_FPS
    ):
        raise MediaError(
            f"{item}: fps must be a finite number > 0 and <= {MAX_FPS:g}, got {fps!r}"
        )
    limit = limits.max_video_frames
    if max_frames is None:
        max_frames = limit
    if not _is_int(max_frames) or not 1 <= max_frames <= limit:
        raise MediaError(
            f"{item}: max_frames={max_frames!r} must be an integer between 1 and {limit} "
            "(MediaLimits.max_video_frames)"
        )
    if not _is_int(min_frames) or not 1 <= min_frames <= max_frames:
        raise MediaError(
            f"{item}: min_frames={min_frames!r} must be between 1 and {max_frames} (max_frames, "
            f"at most MediaLimits.max_video_frames={limit})"
        )
    if spread not in SPREADS:
        raise MediaError(f"{item}: spread must be one of {', '.join(SPREADS)}, got {spread!r}")
    return VideoSampling(
        target_fps=float(fps), min_frames=int(min_frames), max_frames=int(max_frames),
        spread=spread,
    )


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def sample_count(duration: float, frame_count: int, sampling: VideoSampling) -> int:
    """Frames to sample: the target rate over the duration, no more than the video has,
    clamped to [min_frames, max_frames] (a video shorter than min_frames repeats frames)."""
    wanted = min(round(duration * sampling.target_fps), frame_count or math.inf)
    return max(sampling.min_frames, min(sampling.max_frames, wanted))


def sample_offsets(
    duration: float, fps: float, frame_count: int, sampling: VideoSampling
) -> list[float]:
    """Seconds from the start of each frame to sample (see VideoSampling.spread)."""
    if sampling.spread == "whole_seconds" and frame_count and fps > 0:
        return _whole_seconds(duration, fps, frame_count, sampling.max_frames)
    if sampling.spread in ("uniform", "whole_seconds") or not frame_count or fps <= 0:
        count = sample_count(duration, frame_count, sampling)
        return [k * duration / count for k in range(count)]
    if sampling.spread == "segment_centers":
        count = sample_count(duration, frame_count, sampling)
        step = frame_count / count  # the source frames split into `count` equal segments
        # Each segment's middle frame, as transformers' InternVL video processor indexes
        # them: float32 positions, truncated.
        centers = (step / 2 + step * np.arange(count)).astype(np.float32).astype(np.int64)
        return [float(i) / fps for i in centers]
    wanted = max(1, min(round(sampling.target_fps * duration), sampling.max_frames))
    first, last = 0, frame_count - 1
    if duration - 2 > sampling.max_frames * sampling.target_fps:  # skip a second at both ends
        first, last = int(fps), min(int(frame_count - fps), frame_count - 1)
    if first >= last:
        first, last = 0, frame_count - 1
    indices = np.unique(np.linspace(first, last, wanted).astype(int))
    return [float(i) / fps for i in indices]


def _whole_seconds(duration: float, fps: float, frame_count: int, max_frames: int) -> list[float]:
    """The frame at the start of each whole second (frame int(s * fps)); a video longer than
    max_frames seconds: its 0.1 s marks, max_frames of them spread evenly (repeats kept)."""
    last = frame_count - 1
    if duration > max_frames:
        marks = [min(int(round(i * 0.1, 1) * fps), last) for i in range(int(duration / 0.1))]
        if len(marks) > max_frames:
            marks = [marks[i] for i in np.linspace(0, len(marks) - 1, max_frames).astype(int)]
    else:
        marks = [min(int(s * fps), last) for s in range(math.ceil(duration))]
    return [m / fps for m in marks]
