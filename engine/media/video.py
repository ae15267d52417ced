"""Sample a video's frames at a target rate into upright RGB arrays with their timestamps,
seeking to each sample instead of decoding the whole video."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator, Sequence
from fractions import Fraction

import av
import numpy as np
from PIL import Image

from engine.media.budget import RequestBudget
from engine.media.formats import VIDEO_CODECS, check_codec, open_container
from engine.media.image import to_rgb
from engine.media.limits import MediaError, MediaLimits, decoder_errors
from engine.media.orientation import display_matrix, orientation_of
from engine.media.sampling import VideoSampling, sample_offsets
from models.media_inputs import VideoFrames

# Frame times are rationals; this absorbs float rounding when comparing them to targets.
_TIME_EPS = 1e-6


def decode_video(
    data: bytes,
    *,
    sampling: VideoSampling,
    limits: MediaLimits,
    item: str,
    budget: RequestBudget | None = None,
) -> VideoFrames:
    """Decode the frames ``sampling`` selects from the first video stream of ``data``, which
    must be in an allowed container and codec (engine.media.formats).

    Duration and frame size come from the container and stream headers and are checked
    against the limits before any frame is decoded; the decoder itself refuses frames past
    ``max_video_frame_pixels``, and the sampled frames are reserved in ``budget`` (by default
    a budget of their own) before they are allocated.
    """
    budget = budget or RequestBudget.for_limits(limits)
    with decoder_errors(item, "video"):
        try:
            return _decode(data, sampling, limits, item, budget, seek=True)
        except _SeekFailed:
            # Some inputs (raw elementary streams) cannot seek, and a failed seek leaves the
            # demuxer unusable: start over and only decode forward.
            return _decode(data, sampling, limits, item, budget, seek=False)


def frames_from_pixels(
    pixels: np.ndarray | Sequence[Image.Image | np.ndarray],
    *,
    sampling: VideoSampling,
    limits: MediaLimits,
    item: str,
    budget: RequestBudget | None = None,
) -> VideoFrames:
    """Sample in-memory frames as a video playing at ``sampling.target_fps``.

    ``pixels`` is a uint8 array shaped [N, H, W, 3] or [N, 3, H, W], or a sequence of PIL
    images or [H, W, 3] arrays of one size. Unless it holds more than ``max_frames`` (or
    fewer than ``min_frames``) frames, every frame is kept.
    """
    stack = _stack_frames(pixels, item)
    total, height, width = stack.shape[:3]
    _check_frame_size(width, height, limits, item)
    fps = sampling.target_fps
    duration = total / fps
    targets = np.asarray(sample_offsets(duration, fps, total, sampling))
    count = len(targets)
    times = np.arange(total) / fps
    chosen = np.searchsorted(times, targets - _TIME_EPS).clip(max=total - 1)
    out_w, out_h = _fit_budget(width, height, count, limits)
    (budget or RequestBudget.for_limits(limits)).reserve_decoded(count * out_w * out_h * 3, item)
    frames = stack[chosen]
    if (out_w, out_h) != (width, height):
        frames = np.stack([_resize(f, out_w, out_h) for f in frames])
    return VideoFrames(
        frames=np.ascontiguousarray(frames),
        timestamps=times[chosen],
        sampled_fps=count / duration,
        source_fps=fps,
        duration_s=duration,
        source_frame_count=total,
        sampling=sampling,
    )


class _SeekFailed(Exception):
    """The container refused a seek."""


def _decode(
    data: bytes,
    sampling: VideoSampling,
    limits: MediaLimits,
    item: str,
    budget: RequestBudget,
    *,
    seek: bool,
) -> VideoFrames:
    with open_container(data, item, "video") as container:
        if not container.streams.video:
            raise MediaError(f"{item}: the file contains no video stream")
        stream = container.streams.video[0]
        check_codec(stream, VIDEO_CODECS, item, "video")
        # A stream may change resolution mid-way; FFmpeg refuses frames past the limit
        # before allocating them.
        stream.codec_context.options = {"max_pixels": str(limits.max_video_frame_pixels)}
        start, duration, fps, frame_count = _probe(container, stream, data, limits, item)
        _check_frame_size(stream.width, stream.height, limits, item)
        targets = [start + t for t in sample_offsets(duration, fps, frame_count, sampling)]
        count = len(targets)
        cursor = _Cursor(container, stream, fps)
        frames, times = _to_rgb_frames(
            _first_frames_at(cursor, targets, seek=seek), count, limits, item, budget
        )
    return VideoFrames(
        frames=frames,
        timestamps=np.asarray(times, dtype=np.float64) - start,
        sampled_fps=count / duration if duration > 0 else sampling.target_fps,
        source_fps=fps,
        duration_s=duration,
        source_frame_count=frame_count,
        sampling=sampling,
        decoded_frames=cursor.decoded,
    )


# Metadata ----------------------------------------------------------------------------


def _probe(
    container: av.container.InputContainer,
    stream: av.video.stream.VideoStream,
    data: bytes,
    limits: MediaLimits,
    item: str,
) -> tuple[float, float, float, int]:
    """(start_s, duration_s, fps, frame_count) from the headers, checked against the limits."""
    time_base = stream.time_base or Fraction(1, av.time_base)
    start = float(stream.start_time * time_base) if stream.start_time is not None else 0.0
    fps = float(stream.average_rate or stream.guessed_rate or stream.base_rate or 0)
    if stream.duration:
        duration = float(stream.duration * time_base)
    elif container.duration:
        duration = container.duration / av.time_base
    elif stream.frames and fps:
        duration = stream.frames / fps
    else:
        duration = _demuxed_duration(data, fps, limits, item)
    _check_duration(duration, limits, item)
    frame_count = stream.frames or round(duration * fps)
    if not fps:
        fps = frame_count / duration if duration > 0 else 0.0
    return start, duration, fps, frame_count


def _demuxed_duration(data: bytes, fps: float, limits: MediaLimits, item: str) -> float:
    """Duration from packet timestamps, or packet count over ``fps`` for raw streams without
    timestamps, for streams whose headers carry none.

    Reads packets without decoding them, in a separate container so the caller's read
    position is untouched, and stops as soon as the duration limit is passed.
    """
    first = last = None
    packets = 0
    duration = 0.0
    with open_container(data, item, "video") as container:
        for packet in container.demux(container.streams.video[0]):
            if not packet.size:
                continue
            packets += 1
            if packet.pts is not None and packet.time_base is not None:
                begin = float(packet.pts * packet.time_base)
                end = float((packet.pts + (packet.duration or 0)) * packet.time_base)
                first = begin if first is None else min(first, begin)
                last = end if last is None else max(last, end)
                duration = last - first
            elif fps:
                duration = packets / fps
            _check_duration(duration, limits, item)
    if not packets:
        raise MediaError(f"{item}: the video stream has no frames")
    return duration


def _check_duration(duration: float, limits: MediaLimits, item: str) -> None:
    if duration > limits.max_video_duration_s:
        raise MediaError(
            f"{item}: duration {duration:.1f} s exceeds the limit of "
            f"{limits.max_video_duration_s:g} s (MediaLimits.max_video_duration_s)"
        )


def _check_frame_size(width: int, height: int, limits: MediaLimits, item: str) -> None:
    if width * height > limits.max_video_frame_pixels:
        raise MediaError(
            f"{item}: frame size {width}x{height} exceeds the limit of "
            f"{limits.max_video_frame_pixels} pixels (MediaLimits.max_video_frame_pixels)"
        )


# Sampling ----------------------------------------------------------------------------


class _Cursor:
    """A decode position in one video stream: the latest decoded frame and its time."""

    def __init__(
        self,
        container: av.container.InputContainer,
        stream: av.video.stream.VideoStream,
        fps: float,
    ) -> None:
        self._container = container
        self._stream = stream
        self._fps = fps
        self._time_base = stream.time_base or Fraction(1, av.time_base)
        self._frames = container.decode(stream)
        self.frame: av.VideoFrame | None = None
        self.time = -math.inf
        self.decoded = 0

    def keyframe_times(self) -> list[float]:
        """Sorted keyframe times from the container's seek index (empty when it has none)."""
        entries = self._stream.index_entries
        return sorted(float(e.timestamp * self._time_base) for e in entries if e.is_keyframe)

    def seek(self, target: float) -> None:
        """Restart decoding at the keyframe at or before ``target``; the latest frame stays
        until the next ``advance``."""
        offset = math.floor((target + _TIME_EPS) / self._time_base)
        try:
            self._container.seek(offset, stream=self._stream, backward=True)
        except av.FFmpegError as e:
            raise _SeekFailed from e
        self._frames = self._container.decode(self._stream)

    def advance(self) -> bool:
        """Decode the next frame; False at the end of the stream."""
        frame = next(self._frames, None)
        if frame is None:
            return False
        if frame.time is not None:
            self.time = float(frame.time)
        elif self.frame is None:
            self.time = 0.0
        elif self._fps:
            # No pts (raw streams): continue from the previous frame at the nominal rate.
            self.time += 1.0 / self._fps
        self.frame = frame
        self.decoded += 1
        return True


def _first_frames_at(
    cursor: _Cursor, targets: list[float], *, seek: bool
) -> Iterator[tuple[av.VideoFrame, float]]:
    """For each target time, yield (frame, time) of the first frame at or after the target,
    or else of the last frame there is.

    Seeks to the keyframe before a target only when that keyframe lies beyond the frames
    already decoded; otherwise decoding forward is cheaper than restarting from it. Without
    a seek index (GIF), or with ``seek`` false, the video is decoded forward once.
    """
    keyframes: list[float] = []
    if seek:
        cursor.seek(targets[0])
        # Matroska loads its cues on the first seek, so read the index only now.
        keyframes = cursor.keyframe_times()
    for target in targets:
        if cursor.frame is not None and _keyframe_before(keyframes, target) > cursor.time:
            position = cursor.time
            cursor.seek(target)
            if cursor.advance() and cursor.time <= position + _TIME_EPS:
                # The seek went backwards: the index is unreliable, so stop seeking.
                keyframes = []
        while cursor.time < target - _TIME_EPS and cursor.advance():
            pass
        if cursor.frame is None:
            return
        yield cursor.frame, cursor.time


def _keyframe_before(keyframes: list[float], target: float) -> float:
    index = bisect.bisect_right(keyframes, target + _TIME_EPS)
    return keyframes[index - 1] if index else -math.inf


def _to_rgb_frames(
    picks: Iterator[tuple[av.VideoFrame, float]],
    count: int,
    limits: MediaLimits,
    item: str,
    budget: RequestBudget,
) -> tuple[np.ndarray, list[float]]:
    """Convert the picked frames, and only them, to one uint8 [count, H, W, 3] array.

    Output size and orientation follow the first picked frame, downscaled when needed to
    keep all frames within ``max_video_total_pixels``.
    """
    first = next(picks, None)
    if first is None:
        raise MediaError(f"{item}: the video has no decodable frames")
    _check_frame_size(first[0].width, first[0].height, limits, item)
    width, height = _fit_budget(first[0].width, first[0].height, count, limits)
    orientation = orientation_of(display_matrix(first[0]))
    shape = (width, height) if orientation.transpose else (height, width)
    budget.reserve_decoded(count * width * height * 3, item)
    out = np.empty((count, *shape, 3), dtype=np.uint8)
    times: list[float] = []
    previous = None
    for index, (frame, time) in enumerate(itertools.chain([first], picks)):
        if frame is previous:
            out[index] = out[index - 1]
        else:
            rgb = frame.to_ndarray(format="rgb24", width=width, height=height)
            out[index] = orientation.apply(rgb)
        previous = frame
        times.append(time)
    return out, times


def _fit_budget(width: int, height: int, count: int, limits: MediaLimits) -> tuple[int, int]:
    """Frame size, aspect ratio kept, so that ``count`` frames fit max_video_total_pixels."""
    if count * width * height <= limits.max_video_total_pixels:
        return width, height
    scale = math.sqrt(limits.max_video_total_pixels / (count * width * height))
    return max(1, math.floor(width * scale)), max(1, math.floor(height * scale))


# In-memory frames --------------------------------------------------------------------


def _stack_frames(pixels: np.ndarray | Sequence[Image.Image | np.ndarray], item: str) -> np.ndarray:
    """uint8 [N, H, W, 3] from an array or a sequence of images."""
    if isinstance(pixels, np.ndarray):
        stack = pixels
    else:
        if not pixels:
            raise MediaError(f"{item}: the frame list is empty")
        if not all(isinstance(p, Image.Image | np.ndarray) for p in pixels):
            raise MediaError(f"{item}: frames must be PIL images or uint8 arrays")
        arrays = [np.asarray(to_rgb(p)) if isinstance(p, Image.Image) else p for p in pixels]
        if len({a.shape for a in arrays}) != 1:
            raise MediaError(f"{item}: all frames must have the same size and channels")
        stack = np.stack(arrays)
    if stack.dtype != np.uint8:
        raise MediaError(f"{item}: frame arrays must be uint8, got {stack.dtype}")
    if stack.ndim == 4 and stack.shape[-1] != 3 and stack.shape[1] == 3:
        stack = stack.transpose(0, 2, 3, 1)
    if stack.ndim != 4 or stack.shape[-1] != 3 or 0 in stack.shape:
        raise MediaError(
            f"{item}: frames must be shaped [N, H, W, 3] or [N, 3, H, W], got {list(stack.shape)}"
        )
    return stack


def _resize(frame: np.ndarray, width: int, height: int) -> np.ndarray:
    return np.asarray(Image.fromarray(frame).resize((width, height), Image.Resampling.BILINEAR))
