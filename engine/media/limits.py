"""Limits that bound what a request's media may cost, and the single error type for media."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from models.media_inputs import MediaError

log = logging.getLogger(__name__)

MiB = 1024 * 1024

MODALITIES = ("image", "video", "audio")


class MediaFetchError(MediaError):
    """A media URL could not be fetched: unresolvable host, connection failure, timeout or an
    HTTP error status. (URLs refused by policy are plain MediaErrors: the request is wrong.)"""


def check_item_bytes(nbytes: int, limits: MediaLimits, item: str) -> None:
    """Refuse an item of more than ``limits.max_item_bytes`` encoded bytes."""
    if nbytes > limits.max_item_bytes:
        raise MediaError(
            f"{item}: larger than the limit of {limits.max_item_bytes} bytes "
            "(MediaLimits.max_item_bytes)"
        )


@contextmanager
def decoder_errors(item: str, what: str) -> Iterator[None]:
    """Re-raise any failure of a decoder library as "<item>: could not decode the <what> ...".

    Decoders raise whatever their authors chose (Pillow alone raises OSError, SyntaxError,
    ValueError, NotImplementedError, KeyError, struct.error ...), so every exception but our
    own MediaError counts: malformed input must never surface as a server error. The original
    exception is chained for debugging and logged at debug level, never put in the message.
    """
    try:
        yield
    except MediaError:
        raise
    except NotImplementedError as e:
        log.debug("%s: %s decoder failed", item, what, exc_info=True)
        raise MediaError(
            f"{item}: could not decode the {what}: it uses a feature or pixel format that the "
            "decoder does not support"
        ) from e
    except Exception as e:  # noqa: BLE001 - see the docstring
        log.debug("%s: %s decoder failed", item, what, exc_info=True)
        raise MediaError(
            f"{item}: could not decode the {what} (unrecognised, truncated or corrupted data)"
        ) from e


@dataclass(frozen=True)
class MediaLimits:
    """Every bound applied while fetching and decoding media.

    Defaults:
        max_item_bytes: 64 MiB of encoded bytes per item (file, download, base64 payload).
        max_request_bytes: 256 MiB of encoded bytes across all items of one request.
        max_request_decoded_bytes: 1 GiB of decoded media across all items of one request:
            RGB pixels of images and sampled video frames, float32 samples of audio. Each item
            reserves its share from its headers before it is decoded, so a request over the
            cap is refused before the memory is allocated.
        max_image_pixels: 33_177_600 (7680x4320, 8K UHD) pixels per image, checked from the
            header before any pixel is decoded. Raising it past Pillow's own process-wide
            guard (2 x ``PIL.Image.MAX_IMAGE_PIXELS``, about 179 million) has no effect.
        min_image_side: 1 pixel; a 1x1 image is accepted.
        max_video_duration_s: 600 seconds.
        max_video_frames: 768 frames returned per video.
        max_video_frame_pixels: 8_294_400 (3840x2160) pixels per decoded frame.
        max_video_total_pixels: 67_108_864 (8192x8192; 192 MiB of RGB) pixels summed over the
            returned frames; frames are downscaled, aspect ratio kept, to stay within it.
        max_audio_duration_s: 600 seconds.
        min_audio_sample_rate / max_audio_sample_rate: 1000 / 384000 Hz, for sources and for
            the requested output rate.
        max_items_per_modality: image 16, video 4, audio 8. Accepts any mapping; it is stored
            as a sorted tuple of ``(modality, count)`` pairs so the limits stay hashable.
        url_timeout_s: 10 seconds for a whole download, redirects included.
        max_redirects: 5.
        allow_private_networks: False; URLs whose host resolves to a loopback, private,
            link-local, reserved, multicast or unspecified address are refused.
        allowed_domains: None, any public host; otherwise only these domain names and their
            subdomains.
        allowed_local_dirs: empty, local paths and ``file://`` URLs are refused; otherwise
            only files under these directories (symlinks resolved) are read.
    """

    max_item_bytes: int = 64 * MiB
    max_request_bytes: int = 256 * MiB
    max_request_decoded_bytes: int = 1024 * MiB
    max_image_pixels: int = 7680 * 4320
    min_image_side: int = 1
    max_video_duration_s: float = 600.0
    max_video_frames: int = 768
    max_video_frame_pixels: int = 3840 * 2160
    max_video_total_pixels: int = 8192 * 8192
    max_audio_duration_s: float = 600.0
    min_audio_sample_rate: int = 1000
    max_audio_sample_rate: int = 384_000
    max_items_per_modality: Mapping[str, int] | tuple[tuple[str, int], ...] = (
        ("audio", 8),
        ("image", 16),
        ("video", 4),
    )
    url_timeout_s: float = 10.0
    max_redirects: int = 5
    allow_private_networks: bool = False
    allowed_domains: tuple[str, ...] | None = None
    allowed_local_dirs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in (
            "max_item_bytes",
            "max_request_bytes",
            "max_request_decoded_bytes",
            "max_image_pixels",
            "min_image_side",
            "max_video_frames",
            "max_video_frame_pixels",
            "max_video_total_pixels",
            "min_audio_sample_rate",
            "max_audio_sample_rate",
        ):
            _check_int(name, getattr(self, name), low=1)
        _check_int("max_redirects", self.max_redirects, low=0)
        for name in ("max_video_duration_s", "max_audio_duration_s", "url_timeout_s"):
            _check_positive_float(name, getattr(self, name))
        if self.min_audio_sample_rate > self.max_audio_sample_rate:
            raise ValueError(
                "MediaLimits.min_audio_sample_rate must be <= max_audio_sample_rate, got "
                f"{self.min_audio_sample_rate} > {self.max_audio_sample_rate}"
            )
        if not isinstance(self.allow_private_networks, bool):
            raise ValueError("MediaLimits.allow_private_networks must be a bool")
        table = _items_table(self.max_items_per_modality)
        object.__setattr__(self, "max_items_per_modality", table)
        object.__setattr__(self, "allowed_domains", _domains(self.allowed_domains))
        object.__setattr__(self, "allowed_local_dirs", _local_dirs(self.allowed_local_dirs))

    def max_items(self, modality: str) -> int:
        """The most items of ``modality`` one request may carry."""
        return dict(self.max_items_per_modality)[modality]


def _check_int(name: str, value: object, *, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"MediaLimits.{name} must be an integer >= {low}, got {value!r}")


def _check_positive_float(name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"MediaLimits.{name} must be a finite number > 0, got {value!r}")


def _items_table(
    value: Mapping[str, int] | tuple[tuple[str, int], ...],
) -> tuple[tuple[str, int], ...]:
    table = dict(value)
    if set(table) != set(MODALITIES):
        raise ValueError(
            "MediaLimits.max_items_per_modality must give a count for exactly "
            f"{', '.join(MODALITIES)}, got {sorted(table)}"
        )
    for modality, count in table.items():
        _check_int(f"max_items_per_modality[{modality!r}]", count, low=0)
    return tuple(sorted(table.items()))


def _domains(value: tuple[str, ...] | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        raise ValueError("MediaLimits.allowed_domains must be None or a sequence of domain names")
    domains = tuple(d.strip().strip(".").lower() for d in value)
    if not all(domains) or any(c in d for d in domains for c in "/:@ "):
        raise ValueError(
            f"MediaLimits.allowed_domains must hold bare domain names, got {list(value)!r}"
        )
    return domains


def _local_dirs(value: tuple[str, ...]) -> tuple[str, ...]:
    if isinstance(value, str | os.PathLike):
        raise ValueError("MediaLimits.allowed_local_dirs must be a sequence of directories")
    dirs = tuple(os.fspath(d) for d in value)
    if not all(os.path.isabs(d) for d in dirs):
        raise ValueError(
            f"MediaLimits.allowed_local_dirs must hold absolute paths, got {list(dirs)!r}"
        )
    return dirs
