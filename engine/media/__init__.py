"""Media loading for requests: fetch and decode images, videos and audio under limits.

The engine awaits ``load_request_media`` for each request before it reaches the scheduler;
the ``load_*`` functions load single items, with blocking ``*_sync`` twins.
"""

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
