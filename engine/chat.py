"""OpenAI-style chat messages -> messages for the model's chat template + the media they carry.

Content parts understood: `text`, `image_url`, `video_url`, `input_audio` (base64 + format),
`audio_url`, and the Hugging Face style `{"type": "image" | "video" | "audio", <modality>: src}`.
Media parts become `{"type": <modality>}` for the template (which inserts the model's
placeholder) and their sources are collected in prompt order. An assistant message's tool
calls reach the template with their arguments as a mapping (OpenAI sends them as JSON text;
templates render them with `tojson` or iterate over them), as vLLM does.
"""

from __future__ import annotations

import json
from typing import Any

MODALITIES = ("image", "video", "audio")
_URL_PARTS = {"image_url": "image", "video_url": "video", "audio_url": "audio"}


def parse_messages(messages: list[dict]) -> tuple[list[dict], dict[str, list[Any]]]:
    """Returns (template messages, {"image": [...], "video": [...], "audio": [...]})."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...}")
    media: dict[str, list[Any]] = {}
    rendered = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"message {i} must be a dict with a 'role'")
        if message.get("tool_calls"):
            message = {**message, "tool_calls": _tool_calls(message["tool_calls"], i)}
        content = message.get("content")
        if content is None or isinstance(content, str):
            rendered.append({**message, "content": content or ""})
            continue
        if not isinstance(content, list):
            raise ValueError(f"message {i} content must be a string or a list of parts")
        parts = [_parse_part(part, i, media) for part in content]
        if all(p["type"] == "text" for p in parts):  # text-only templates expect a string
            rendered.append({**message, "content": "\n".join(p["text"] for p in parts)})
        else:
            rendered.append({**message, "content": parts})
    return rendered, {k: v for k, v in media.items() if v}


def _tool_calls(calls: Any, i: int) -> list[dict]:
    if not isinstance(calls, list):
        raise ValueError(f"message {i}: tool_calls must be a list")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"message {i}: each tool call needs a function with a name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise ValueError(f"message {i}: tool call {function['name']!r} has arguments "
                                 "that are not JSON") from None
        out.append({**call, "function": {**function, "arguments": arguments}})
    return out


def _parse_part(part: Any, i: int, media: dict[str, list[Any]]) -> dict:
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise ValueError(f"message {i}: each content part must be a dict with a string 'type'")
    kind = part["type"]
    if kind == "text":
        return {"type": "text", "text": str(part.get("text", ""))}
    if kind in _URL_PARTS:
        value = part.get(kind)
        url = value.get("url") if isinstance(value, dict) else value
        if not url:
            raise ValueError(f"message {i}: {kind} part needs {{'{kind}': {{'url': ...}}}}")
        return _add(media, _URL_PARTS[kind], url)
    if kind == "input_audio":
        value = part.get("input_audio") or {}
        data, fmt = value.get("data"), value.get("format", "wav")
        if not data:
            raise ValueError(f"message {i}: input_audio part needs base64 'data' and 'format'")
        return _add(media, "audio", f"data:audio/{fmt};base64,{data}")
    if kind in MODALITIES:
        source = part.get(kind, part.get("url"))
        if source is None:
            raise ValueError(f"message {i}: {kind} part has no {kind!r} field")
        return _add(media, kind, source)
    raise ValueError(
        f"message {i}: unsupported content part type {kind!r} (supported: text, image_url, "
        "video_url, input_audio, audio_url, image, video, audio)"
    )


def _add(media: dict[str, list[Any]], modality: str, source: Any) -> dict:
    media.setdefault(modality, []).append(source)
    return {"type": modality}
