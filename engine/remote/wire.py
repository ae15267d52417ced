"""A chat request as the JSON body an OpenAI-compatible server takes: media parts become
`image_url` / `video_url` data URLs and `input_audio` parts, checked against the media limits
before anything is sent; sampling parameters become OpenAI's fields (and vLLM's extensions
only where they differ from the defaults, so that strict servers are not bothered).
"""

from __future__ import annotations

import base64
import io
import json
import mimetypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.media.limits import MODALITIES, MediaError, MediaLimits
from engine.remote.config import RemoteConfig
from engine.sampling_params import SamplingParams

_URL_PARTS = {"image_url": "image", "video_url": "video", "audio_url": "audio"}
# input_audio's format for each audio MIME type (OpenAI documents wav and mp3; vLLM and
# mmserve decode the others too).
_AUDIO_FORMATS = {"audio/wav": "wav", "audio/x-wav": "wav", "audio/mpeg": "mp3",
                  "audio/flac": "flac", "audio/x-flac": "flac", "audio/ogg": "ogg"}


@dataclass(frozen=True)
class WireRequest:
    """A request ready to send: the JSON body, and the modality of each media item it
    carries, in prompt order."""

    body: bytes
    media: tuple[str, ...]


def request_body(
    model: str, messages: list[dict], params: SamplingParams, config: RemoteConfig
) -> WireRequest:
    """The streaming chat-completion request. Raises MediaError (a ValueError naming the item
    and the limit) for media over the limits or in a form that cannot be sent, ValueError
    for malformed messages, NotImplementedError for logprobs."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    limits = config.media_limits
    counter = _MediaCounter(limits)
    wire = [_message(m, i, counter) for i, m in enumerate(messages)]
    body = {"model": model, "messages": wire, "stream": True,
            "stream_options": {"include_usage": True}, **_sampling(params)}
    if config.return_token_ids:
        body["return_token_ids"] = True
    data = json.dumps(body, ensure_ascii=False).encode()
    if len(data) > config.max_body_bytes:
        raise MediaError(
            f"the request is {len(data) / 2**20:.1f} MiB once its media is base64-encoded, "
            f"more than the {config.max_body_bytes / 2**20:.0f} MiB the server accepts "
            "(RemoteConfig.max_body_bytes, --backend-max-body-mb); send fewer or smaller files"
        )
    return WireRequest(data, tuple(counter.order))


def _sampling(p: SamplingParams) -> dict[str, Any]:
    if p.logprobs is not None:
        raise NotImplementedError("logprobs are not built for remote engines yet")
    if p.lora is not None:
        raise NotImplementedError("LoRA adapters are chosen on the server for remote engines")
    fields: dict[str, Any] = {"max_tokens": p.max_tokens, "temperature": p.temperature,
                              "top_p": p.top_p}
    if p.seed is not None:
        fields["seed"] = p.seed
    if p.stop:
        fields["stop"] = list(p.stop)
    defaults = SamplingParams()
    for name in ("top_k", "min_p", "repetition_penalty", "ignore_eos", "skip_special_tokens"):
        if getattr(p, name) != getattr(defaults, name):
            fields[name] = getattr(p, name)
    if p.stop_token_ids:
        fields["stop_token_ids"] = list(p.stop_token_ids)
    return fields


class _MediaCounter:
    """Names items as the servers do ("image 2": the second image of the request) and checks
    the per-item, per-modality and per-request limits."""

    def __init__(self, limits: MediaLimits) -> None:
        self.limits = limits
        self.counts = dict.fromkeys(MODALITIES, 0)
        self.order: list[str] = []
        self.total = 0

    def next_item(self, modality: str) -> str:
        self.counts[modality] += 1
        self.order.append(modality)
        n, most = self.counts[modality], self.limits.max_items(modality)
        if n > most:
            raise MediaError(
                f"the request has more than {most} {modality} items, the limit "
                f"(MediaLimits.max_items_per_modality[{modality!r}])"
            )
        return f"{modality} {n}"

    def charge(self, item: str, nbytes: int) -> None:
        if nbytes > self.limits.max_item_bytes:
            raise MediaError(
                f"{item}: larger than the limit of {self.limits.max_item_bytes} bytes "
                "(MediaLimits.max_item_bytes, what fits in one request to the server)"
            )
        self.total += nbytes
        if self.total > self.limits.max_request_bytes:
            raise MediaError(
                f"{item}: the request's media exceeds the limit of "
                f"{self.limits.max_request_bytes} bytes (MediaLimits.max_request_bytes)"
            )


def _message(message: Any, i: int, counter: _MediaCounter) -> dict:
    if not isinstance(message, dict) or "role" not in message:
        raise ValueError(f"message {i} must be a dict with a 'role'")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return message
    if not isinstance(content, list):
        raise ValueError(f"message {i} content must be a string or a list of parts")
    return {**message, "content": [_part(p, i, counter) for p in content]}


def _part(part: Any, i: int, counter: _MediaCounter) -> dict:
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if not isinstance(part, dict) or "type" not in part:
        raise ValueError(f"message {i}: each content part must be a dict with a 'type'")
    kind = part["type"]
    if kind == "text":
        return part
    if kind in _URL_PARTS:
        value = part.get(kind)
        url = value.get("url") if isinstance(value, dict) else value
        if not isinstance(url, str) or not url:
            raise ValueError(f"message {i}: {kind} part needs {{'{kind}': {{'url': ...}}}}")
        item = counter.next_item(_URL_PARTS[kind])
        if url.startswith("data:"):
            counter.charge(item, len(url) * 3 // 4)
        return {"type": kind, kind: {"url": url}}
    if kind == "input_audio":
        value = part.get("input_audio") or {}
        data = value.get("data") if isinstance(value, dict) else None
        if not isinstance(data, str) or not data:
            raise ValueError(f"message {i}: input_audio part needs base64 'data' and 'format'")
        counter.charge(counter.next_item("audio"), len(data) * 3 // 4)
        return part
    if kind in MODALITIES:
        source = part.get(kind, part.get("url"))
        if source is None:
            raise ValueError(f"message {i}: {kind} part has no {kind!r} field")
        return _media(kind, source, counter.next_item(kind), counter)
    raise ValueError(
        f"message {i}: unsupported content part type {kind!r} (supported: text, image_url, "
        "video_url, input_audio, audio_url, image, video, audio)"
    )


def _media(modality: str, source: Any, item: str, counter: _MediaCounter) -> dict:
    """One media item as a wire part: URLs pass through (the server fetches them), bytes,
    files and PIL images travel as base64."""
    if isinstance(source, str) and source.startswith(("http://", "https://", "data:")):
        if source.startswith("data:"):
            counter.charge(item, len(source) * 3 // 4)
        key = f"{modality}_url"
        return {"type": key, key: {"url": source}}
    data, mime = _read(source, modality, item, counter.limits)
    counter.charge(item, len(data))
    encoded = base64.b64encode(data).decode("ascii")
    if modality == "audio":
        fmt = _AUDIO_FORMATS.get(mime or "")
        if fmt is None:
            raise MediaError(f"{item}: unrecognised audio format; attach WAV, MP3, FLAC or OGG")
        return {"type": "input_audio", "input_audio": {"data": encoded, "format": fmt}}
    key = f"{modality}_url"
    # A type the sniffer does not know is left to the server's decoder, which reads content.
    url = f"data:{mime or 'application/octet-stream'};base64,{encoded}"
    return {"type": key, key: {"url": url}}


def _read(source: Any, modality: str, item: str, limits: MediaLimits) -> tuple[bytes, str | None]:
    """The item's bytes and MIME type (from its content, else its file name)."""
    if isinstance(source, bytes | bytearray | memoryview):
        data = bytes(source)
        return data, sniff(data)
    if isinstance(source, str | os.PathLike):
        path = Path(source).expanduser()
        try:
            size = path.stat().st_size
            if not path.is_file():
                raise MediaError(f"{item}: {path.name} is not a regular file")
            if size > limits.max_item_bytes:
                raise MediaError(
                    f"{item}: {path.name} is larger than the limit of {limits.max_item_bytes} "
                    "bytes (MediaLimits.max_item_bytes, what fits in one request to the server)"
                )
            data = path.read_bytes()
        except FileNotFoundError as e:
            raise MediaError(f"{item}: local file not found: {path.name}") from e
        except OSError as e:
            raise MediaError(f"{item}: could not read local file {path.name}") from e
        return data, sniff(data) or mimetypes.guess_type(path.name)[0]
    if _is_pil_image(source):
        buffer = io.BytesIO()
        source.save(buffer, format="PNG")
        return buffer.getvalue(), "image/png"
    raise MediaError(
        f"{item}: a remote engine sends {modality} as bytes, a file path, a URL"
        f"{' or a PIL image' if modality == 'image' else ''}; got {type(source).__name__}"
    )


def _is_pil_image(source: Any) -> bool:
    return any(c.__module__.startswith("PIL.") and c.__name__ == "Image"
               for c in type(source).__mro__)


def sniff(data: bytes) -> str | None:
    """The MIME type of common image, video and audio files from their first bytes."""
    head = data[:16]
    for magic, offset, mime in _MAGIC:
        if head[offset:offset + len(magic)] == magic:
            if mime == "riff":
                return {b"WAVE": "audio/wav", b"WEBP": "image/webp", b"AVI ": "video/x-msvideo"
                        }.get(head[8:12])
            if mime == "iso":
                return "video/quicktime" if head[8:10] == b"qt" else "video/mp4"
            return mime
    if head[:2] in (b"\xff\xfb", b"\xff\xf3", b"\xff\xf2"):  # MPEG audio frame sync
        return "audio/mpeg"
    return None


_MAGIC: tuple[tuple[bytes, int, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", 0, "image/png"),
    (b"\xff\xd8\xff", 0, "image/jpeg"),
    (b"GIF8", 0, "image/gif"),
    (b"BM", 0, "image/bmp"),
    (b"II*\x00", 0, "image/tiff"),
    (b"MM\x00*", 0, "image/tiff"),
    (b"RIFF", 0, "riff"),
    (b"ftyp", 4, "iso"),
    (b"\x1aE\xdf\xa3", 0, "video/webm"),
    (b"fLaC", 0, "audio/flac"),
    (b"OggS", 0, "audio/ogg"),
    (b"ID3", 0, "audio/mpeg"),
)

