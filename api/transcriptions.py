"""OpenAI's speech-to-text routes, served by a Whisper engine (engine/transcription.py):
`POST /v1/audio/transcriptions` and `/v1/audio/translations`, a multipart form as OpenAI's
client sends it: `file`, `model`, `language`, `prompt`, `response_format` (json, text, srt, vtt,
verbose_json with segments at the model's timestamps, their no-speech probability included),
`temperature`, `timestamp_granularities[]` (segment, word: verbose_json then carries `words`,
each `{word, start, end}`, from the alignment heads' cross-attention; `segments` when segment is
asked or no granularity is; word needs verbose_json and a checkpoint with alignment heads, else
a 400 naming which), `stream` (server-sent `transcript.text.delta` events, one per segment,
then `transcript.text.done`).

The body is refused past the server's byte limit (413, naming it) and audio past
`MediaLimits.max_audio_duration_s` or that does not decode (400, naming the problem), as on
the other routes; a model that is not a Whisper checkpoint is a 400.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from fastapi.routing import APIRoute

from api.bodies import read_body
from api.errors import APIError, from_exception
from engine.media import load_audio_sync
from engine.transcription import (
    TEMPERATURES,
    Transcript,
    TranscriptionOptions,
    alignment_heads,
    transcribe,
    whisper_tokens,
)

FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
FIELDS = {"file", "model", "language", "prompt", "response_format", "temperature",
          "timestamp_granularities[]", "timestamp_granularities", "stream", "chunking_strategy",
          "include[]"}


def audio_route_class(max_body_bytes: int) -> type[APIRoute]:
    """Routes taking a multipart form: its size checked before it is parsed, every failure in
    the OpenAI error shape."""

    class AudioRoute(APIRoute):
        def get_route_handler(self) -> Callable:
            handler = super().get_route_handler()

            async def handle(request: Request) -> Response:
                try:
                    kind = request.headers.get("content-type", "")
                    if not kind.startswith("multipart/form-data"):
                        raise APIError(415, "send the audio as multipart/form-data (a `file` "
                                       f"field and the options), not {kind or 'no type'}")
                    request._body = await read_body(request, max_body_bytes)
                    return await handler(request)
                except Exception as e:  # noqa: BLE001 - every error becomes an OpenAI body
                    return from_exception(e).response()

            return handle

    return AudioRoute


def add_audio_routes(router: APIRouter, engine_for: Callable[[str], Any],
                     max_body_bytes: int) -> None:
    """The two routes on `router`; `engine_for(model)` finds a model's engine (404 else)."""
    route = audio_route_class(max_body_bytes)
    for path, task in (("/audio/transcriptions", "transcribe"),
                       ("/audio/translations", "translate")):
        router.add_api_route(path, _endpoint(engine_for, task), methods=["POST"],
                             route_class_override=route)


def _endpoint(engine_for: Callable[[str], Any], task: str) -> Callable:
    async def endpoint(request: Request) -> Response:
        form = await request.form()
        unknown = sorted(set(form) - FIELDS)
        if unknown:
            raise APIError(400, f"unknown field(s) {', '.join(unknown)}", param=unknown[0])
        upload = form.get("file")
        if upload is None or isinstance(upload, str):
            raise APIError(400, "the form has no `file` (the audio to transcribe)",
                           param="file")
        model = _text(form, "model")
        if not model:
            raise APIError(400, "the form has no `model`", param="model")
        llm = engine_for(model)
        ids = whisper_tokens(llm)
        fmt = _text(form, "response_format") or "json"
        if fmt not in FORMATS:
            raise APIError(400, f"response_format must be one of {', '.join(FORMATS)}, got "
                           f"{fmt!r}", param="response_format")
        grains = form.getlist("timestamp_granularities[]") + form.getlist(
            "timestamp_granularities")
        if set(grains) - {"segment", "word"}:
            raise APIError(400, f"timestamp_granularities must be segment or word, got {grains}",
                           param="timestamp_granularities")
        words = "word" in grains
        if words:
            if fmt != "verbose_json":
                raise APIError(400, "word timestamps come in response_format verbose_json, got "
                               f"{fmt!r}", param="timestamp_granularities")
            try:
                alignment_heads(llm, ids)
            except ValueError as e:
                raise APIError(400, str(e), param="timestamp_granularities") from None
        language = _text(form, "language") or None
        if task == "translate" or not ids.multilingual:
            language = language or ("en" if not ids.multilingual else None)
        temperature = _float(form, "temperature")  # 0 (the default): greedy, with fallback
        options = TranscriptionOptions(
            task=task, language=language, prompt=_text(form, "prompt") or None,
            timestamps=fmt in ("srt", "vtt", "verbose_json") or bool(grains),
            temperatures=(temperature,) if temperature else TEMPERATURES, word_timestamps=words)
        data = await upload.read()
        clip = await asyncio.to_thread(load_audio_sync, data, sample_rate=16000)
        stream = transcribe(llm, clip.samples, options)
        if _text(form, "stream") in ("true", "1", "True"):
            return StreamingResponse(_events(stream), media_type="text/event-stream")
        transcript = None
        async for item in stream:
            transcript = item
        return _render(transcript, fmt, task, set(grains) or {"segment"})

    return endpoint


def _text(form, name: str) -> str:
    value = form.get(name)
    return "" if value is None or not isinstance(value, str) else value.strip()


def _float(form, name: str) -> float | None:
    value = _text(form, name)
    if not value:
        return None
    try:
        number = float(value)
    except ValueError:
        raise APIError(400, f"{name} must be a number, got {value!r}", param=name) from None
    if not 0.0 <= number <= 1.0:
        raise APIError(400, f"{name} must be in [0, 1], got {number}", param=name)
    return number


async def _events(stream):
    text = []
    try:
        async for item in stream:
            if isinstance(item, Transcript):
                done = {"type": "transcript.text.done", "text": item.text}
                yield f"data: {json.dumps(done)}\n\n"
            else:
                text.append(item.text)
                delta = {"type": "transcript.text.delta", "delta": item.text}
                yield f"data: {json.dumps(delta)}\n\n"
    except Exception as e:  # noqa: BLE001 - the stream has begun: the error is an event
        yield f"data: {json.dumps(from_exception(e).body())}\n\n"
    yield "data: [DONE]\n\n"


def _render(t: Transcript, fmt: str, task: str, grains: set[str]) -> Response:
    if fmt == "text":
        return PlainTextResponse(t.text)
    if fmt == "json":
        return JSONResponse({"text": t.text})
    if fmt == "verbose_json":
        body: dict[str, Any] = {"task": task, "language": t.language, "duration": t.duration,
                                "text": t.text}
        if "segment" in grains:
            body["segments"] = [{
                "id": s.id, "seek": s.seek, "start": s.start, "end": s.end, "text": s.text,
                "tokens": s.tokens, "temperature": s.temperature, "avg_logprob": s.avg_logprob,
                "compression_ratio": s.compression_ratio, "no_speech_prob": s.no_speech_prob,
            } for s in t.segments]
        if "word" in grains:  # OpenAI's words: the text without its leading space
            body["words"] = [{"word": w.word.strip(), "start": w.start, "end": w.end}
                             for w in t.words]
        return JSONResponse(body)
    lines = ["WEBVTT", ""] if fmt == "vtt" else []
    for i, s in enumerate(t.segments, start=1):
        if fmt == "srt":
            lines.append(str(i))
        lines += [f"{_stamp(s.start, fmt)} --> {_stamp(s.end, fmt)}", s.text.strip(), ""]
    return PlainTextResponse("\n".join(lines))


def _stamp(seconds: float, fmt: str) -> str:
    ms = round(seconds * 1000)
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    sep = "," if fmt == "srt" else "."
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"
