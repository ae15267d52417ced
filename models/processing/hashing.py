"""Content identity of decoded media items: a blake3 digest of what the model will see.

The digest covers the decoded content (never the encoded bytes, so the same pixels from a PNG
and a lossless WebP hash equal), the model id and the processor options. Every field is
written as a tag and a length prefix before its bytes, so no two different inputs produce
the same byte stream, and arrays carry their dtype and shape, so reshaped bytes differ.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import numpy as np
from blake3 import blake3
from PIL import Image

from models.media_inputs import AudioClip, VideoFrames

_DOMAIN = "mmserve.media-identity.v1"


def hash_image(
    img: Image.Image, *, model_id: str = "", processor_kwargs: Mapping[str, Any] | None = None
) -> str:
    """Hex digest of an image's mode, size, palette (P/PA modes) and pixels."""
    fields = _Fields("image", model_id, processor_kwargs)
    fields.text("mode", img.mode)
    fields.text("size", f"{img.width}x{img.height}")
    if img.palette is not None and img.mode in ("P", "PA"):
        fields.text("palette.mode", img.palette.mode)
        fields.raw("palette", bytes(img.getpalette(img.palette.mode) or ()))
        fields.text("transparency", repr(img.info.get("transparency")))
    fields.raw("pixels", img.tobytes())
    return fields.hexdigest()


def hash_video(
    video: VideoFrames,
    *,
    model_id: str = "",
    processor_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Hex digest of a video's sampled frames, their timestamps and the sampling request."""
    fields = _Fields("video", model_id, processor_kwargs)
    fields.text("sampling", _canonical_json(asdict(video.sampling)))
    fields.array("timestamps", video.timestamps)
    fields.array("frames", video.frames)
    return fields.hexdigest()


def hash_audio(
    audio: AudioClip, *, model_id: str = "", processor_kwargs: Mapping[str, Any] | None = None
) -> str:
    """Hex digest of an audio clip's samples and sample rate."""
    fields = _Fields("audio", model_id, processor_kwargs)
    fields.text("sample_rate", str(audio.sample_rate))
    fields.array("samples", audio.samples)
    return fields.hexdigest()


def hash_part(identity: str, **part: Any) -> str:
    """Hex digest of a part (say one window of a clip, `clip_window=3000`) of an item whose own
    digest is `identity`: the item's samples are not read again."""
    fields = _Fields("part", "", part)
    fields.text("item", identity)
    return fields.hexdigest()


def hash_item(
    modality: str,
    item: Image.Image | VideoFrames | AudioClip,
    *,
    model_id: str = "",
    processor_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Hex digest of a loaded item of ``modality`` ("image", "video" or "audio")."""
    hashers = {"image": hash_image, "video": hash_video, "audio": hash_audio}
    if modality not in hashers:
        raise ValueError(f"unknown modality {modality!r}; expected one of {sorted(hashers)}")
    return hashers[modality](item, model_id=model_id, processor_kwargs=processor_kwargs)


class _Fields:
    """Writes (tag, length, bytes) records into one blake3 hasher."""

    def __init__(
        self, modality: str, model_id: str, processor_kwargs: Mapping[str, Any] | None
    ) -> None:
        self._hasher = blake3()
        self.text("domain", _DOMAIN)
        self.text("modality", modality)
        self.text("model_id", model_id)
        self.text("processor_kwargs", _canonical_json(dict(processor_kwargs or {})))

    def raw(self, tag: str, payload: bytes | memoryview) -> None:
        name = tag.encode()
        size = payload.nbytes if isinstance(payload, memoryview) else len(payload)
        self._hasher.update(len(name).to_bytes(2, "little") + name + size.to_bytes(8, "little"))
        self._hasher.update(payload)

    def text(self, tag: str, value: str) -> None:
        self.raw(tag, value.encode())

    def array(self, tag: str, values: np.ndarray) -> None:
        contiguous = np.ascontiguousarray(values)
        self.text(f"{tag}.dtype", contiguous.dtype.str)
        self.text(f"{tag}.shape", json.dumps(list(contiguous.shape)))
        # A flat uint8 view of the same memory: hashed without a copy.
        self.raw(tag, memoryview(contiguous.reshape(-1).view(np.uint8)))

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()


def _canonical_json(value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except TypeError as e:
        raise TypeError(f"processor options must be JSON-serialisable: {e}") from e
