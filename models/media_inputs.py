"""The decoded media a processor receives, as engine.media's loaders make them: audio clips,
sampled video frames and the sampling asked for, and the error a bad item raises (a 4xx over
HTTP). Plain data: importable without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


# Sampling faster than the fastest cameras record only repeats frames.
MAX_FPS = 240.0


class MediaError(ValueError):
    """A media item was refused or could not be decoded.

    The message names the item ("image 2"), the problem and, where one applies, the limit
    and the ``MediaLimits`` field that sets it. It never carries decoder tracebacks, internal
    filesystem paths or resolved network addresses; the original exception, if any, is
    chained as ``__cause__`` for debugging.
    """


@dataclass
class AudioClip:
    """Mono audio."""

    samples: np.ndarray  # float32 [N], nominally within [-1, 1]
    sample_rate: int

    @property
    def duration_s(self) -> float:
        """Length in seconds."""
        return len(self.samples) / self.sample_rate


@dataclass(frozen=True)
class VideoSampling:
    """How frames were chosen: ``target_fps`` clamped to [min_frames, max_frames] frames.

    ``spread`` places them: "uniform" at k * duration / count from the start; "frame_linspace"
    on source frame indices spaced evenly from the first frame to the last inclusive, a second
    skipped at both ends when the video is longer than max_frames at target_fps plus two
    seconds, repeated indices dropped (transformers' SmolVLM video sampling); "segment_centers"
    on the middle source frame of each of `count` equal segments (transformers' InternVL);
    "whole_seconds" on the frame starting each whole second, or for a video longer than
    max_frames seconds on max_frames of its 0.1 s marks spread evenly (transformers' MiniCPM-V
    4.6 video sampling; target_fps 1 sets the rate of frames given in memory).
    """

    target_fps: float
    min_frames: int
    max_frames: int
    spread: str = "uniform"


@dataclass
class VideoFrames:
    """Frames sampled from one video, in display order and orientation."""

    frames: np.ndarray  # uint8 [N, H, W, 3] RGB
    timestamps: np.ndarray  # float64 [N], seconds since the start of the video
    sampled_fps: float  # N / duration_s: the sampling rate actually used
    source_fps: float
    duration_s: float
    source_frame_count: int
    sampling: VideoSampling
    # Frames the decoder produced to obtain these; with seeking, far fewer than the video has.
    decoded_frames: int = 0
    # The sound track, decoded from the same source when the loader was asked for it
    # (`audio_sample_rate` in its video options): None when not asked for or absent.
    audio: AudioClip | None = None
    # Whether the source has a sound track: None when not asked for; False when asked and
    # there is none (frames given in memory never have one).
    has_audio_track: bool | None = None
