"""Media loading for requests: fetch and decode images, videos and audio under limits.

The engine awaits ``load_request_media`` for each request before it reaches the scheduler;
the ``load_*`` functions load single items, with blocking ``*_sync`` twins.

Names are imported on first use (PEP 562, as `engine` does): the limits and errors come without
the decoders (PyAV, Pillow, soundfile), which load with the first loader a request needs, so an
engine serving text, and the UI, start without them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "DEFAULT_LIMITS": "engine.media.loader",
    "AudioClip": "engine.media.audio",
    "MediaError": "engine.media.limits",
    "MediaFetchError": "engine.media.limits",
    "MediaLimits": "engine.media.limits",
    "VideoFrames": "engine.media.video",
    "VideoSampling": "engine.media.sampling",
    "load_audio": "engine.media.loader",
    "load_audio_sync": "engine.media.loader",
    "load_image": "engine.media.loader",
    "load_image_sync": "engine.media.loader",
    "load_request_media": "engine.media.loader",
    "load_request_media_sync": "engine.media.loader",
    "load_video": "engine.media.loader",
    "load_video_sync": "engine.media.loader",
}

__all__ = [
    "DEFAULT_LIMITS",
    "AudioClip",
    "MediaError",
    "MediaFetchError",
    "MediaLimits",
    "VideoFrames",
    "VideoSampling",
    "load_audio",
    "load_audio_sync",
    "load_image",
    "load_image_sync",
    "load_request_media",
    "load_request_media_sync",
    "load_video",
    "load_video_sync",
]

if TYPE_CHECKING:
    from engine.media.audio import AudioClip
    from engine.media.limits import MediaError, MediaFetchError, MediaLimits
    from engine.media.loader import (
        DEFAULT_LIMITS,
        load_audio,
        load_audio_sync,
        load_image,
        load_image_sync,
        load_request_media,
        load_request_media_sync,
        load_video,
        load_video_sync,
    )
    from engine.media.sampling import VideoSampling
    from engine.media.video import VideoFrames


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine.media' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
