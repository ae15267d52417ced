"""What goes wrong talking to a remote server, and what is refused before anything is sent:
media over the limits, a request body larger than the server takes, unknown audio formats,
bad configuration; then HTTP 5xx and 503, a server that never answers, a refused connection,
a response that is not an event stream, and an error event in the middle of a stream."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from engine import SamplingParams
from engine.media import MediaError
from engine.remote import BackendError, ModelCard, RemoteConfig, RemoteEngine
from engine.remote.wire import request_body, sniff
from tests.api_fixtures import running_server
from tests.media_fixtures import VideoSpec, encode_image, encode_soundfile, encode_video, gradient
from tests.media_fixtures import tone as make_tone

MiB = 2**20
PARAMS = SamplingParams(max_tokens=4)


def closed_port_url() -> str:
    """A 127.0.0.1 URL nothing listens on: any request would be refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def engine_at(url: str, **options) -> RemoteEngine:
    return RemoteEngine(RemoteConfig(url, **options), ModelCard("m"))


async def run(llm: RemoteEngine, messages: list[dict]) -> list:
    return [out async for out in llm.chat(messages, PARAMS)]


def image(data) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": data}]}]


# ---- refused before sending ----------------------------------------------------------------


async def test_media_over_the_limits_is_refused_before_sending():
    # Nothing listens at the URL: a request that was sent would fail to connect instead.
    llm = engine_at(closed_port_url(), max_body_bytes=1 * MiB)
    limit = llm.info.media_limits.max_item_bytes
    assert limit == (1 * MiB - 256 * 1024) * 3 // 4, "what fits in the body once base64-encoded"
    with pytest.raises(MediaError, match=rf"^image 1: larger than the limit of {limit} bytes"):
        await run(llm, image(b"\x89PNG\r\n\x1a\n" + bytes(limit)))
    many = [{"role": "user", "content": [{"type": "image", "image": b"GIF89a"}] * 17}]
    with pytest.raises(MediaError, match=r"more than 16 image items.*max_items_per_modality"):
        await run(llm, many)
    text = [{"role": "user", "content": "x" * (1 * MiB)}]
    with pytest.raises(MediaError, match=r"^the request is 1\.0 MiB .* the 1 MiB the server"):
        await run(llm, text)
    audio = [{"role": "user", "content": [{"type": "audio", "audio": b"not audio at all"}]}]
    with pytest.raises(MediaError, match="audio 1: unrecognised audio format"):
        await run(llm, audio)
    with pytest.raises(MediaError, match="audio 1: local file not found: nope.wav"):
        await run(llm, [{"role": "user", "content": [{"type": "audio", "audio": "/no/nope.wav"}]}])
    assert llm.stats()["requests_failed"] == 5 and llm.stats()["requests_running"] == 0


def test_media_travels_as_openai_parts():
    wav = encode_soundfile(make_tone(440, 16000, 0.1), 16000, "WAV")
    mp4 = encode_video(VideoSpec(frames=2, width=32, height=32))
    messages = [{"role": "user", "content": [
        {"type": "image", "image": gradient(8, 8)},  # a PIL image
        {"type": "video", "video": mp4},
        {"type": "audio", "audio": wav},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        "and some text",
    ]}]
    wire = request_body("m", messages, PARAMS, RemoteConfig("http://127.0.0.1:1"))
    assert wire.media == ("image", "video", "audio", "image")
    image, video, audio, url, text = json.loads(wire.body)["messages"][0]["content"]
    assert image["image_url"]["url"].startswith("data:image/png;base64,")
    assert video["video_url"]["url"].startswith("data:video/mp4;base64,")
    assert audio == {"type": "input_audio", "input_audio": {
        "data": audio["input_audio"]["data"], "format": "wav"}}
    assert url == {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    assert text == {"type": "text", "text": "and some text"}


@pytest.mark.parametrize(
    ("data", "mime"),
    [(encode_image(gradient(), "PNG"), "image/png"), (encode_image(gradient(), "JPEG"),
     "image/jpeg"), (encode_image(gradient(), "WEBP"), "image/webp"),
     (encode_soundfile(make_tone(440, 8000, 0.1), 8000, "FLAC"), "audio/flac"),
     (b"ID3\x04rest", "audio/mpeg"), (b"\x1aE\xdf\xa3rest", "video/webm"),
     (b"plain text", None)],
    ids=["png", "jpeg", "webp", "flac", "mp3", "webm", "unknown"],
)
def test_media_types_are_sniffed(data, mime):
    assert sniff(data) == mime


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [({"base_url": "ftp://host/v1"}, "http:// or https://"),
     ({"base_url": "http://user:pw@host/v1"}, "credentials"),
     ({"base_url": ""}, "server's URL"),
     ({"timeout_s": 0}, "timeout_s must be a finite number > 0"),
     ({"max_body_bytes": 1000}, "max_body_bytes must be an integer >= 1048576"),
     ({"api_key": "a\nb"}, "single-line")],
)
def test_bad_configuration_names_the_field(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        RemoteConfig(**{"base_url": "http://127.0.0.1:8000", **kwargs})


def test_a_base_url_without_a_path_gets_v1():
    assert RemoteConfig("http://gpu-box:8000").base_url == "http://gpu-box:8000/v1"
    assert RemoteConfig("https://h/openai/v1/").base_url == "https://h/openai/v1"
    assert RemoteConfig("https://h/openai/v1/").root_url == "https://h/openai"


# ---- server failures -------------------------------------------------------------------------


def failing_app() -> FastAPI:
    app = FastAPI()

    @app.post("/{kind}/v1/chat/completions")
    async def chat(kind: str, request: Request):
        if kind == "busy":
            return JSONResponse({"error": {"message": "queue full", "code": "queue_full"}},
                                status_code=503)
        if kind == "broken":
            return PlainTextResponse("Internal Server Error", status_code=500)
        if kind == "silent":
            await asyncio.sleep(30)
        if kind == "html":
            return PlainTextResponse("<html>a login page</html>", media_type="text/html")

        async def events():
            yield 'data: {"choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n'
            if kind == "in-band":
                yield 'data: {"error":{"message":"the engine stopped","code":503}}\n\n'
            else:
                yield "data: {not json\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def failing():
    with running_server(failing_app()) as base:
        yield base


@pytest.mark.parametrize(
    ("kind", "message"),
    [("busy", r"is busy \(503: queue full\); try again"),
     ("broken", r"failed \(500: Internal Server Error\)"),
     ("html", "answered with text/html.*not an event stream"),
     ("in-band", "failed while generating: the engine stopped"),
     ("garbled", "sent an event that is not JSON")],
)
async def test_server_failures_are_plain_errors(failing, kind, message):
    llm = engine_at(f"{failing}/{kind}/v1")
    with pytest.raises(BackendError, match=message):
        await run(llm, [{"role": "user", "content": "Hello"}])


async def test_a_server_that_sends_nothing_times_out(failing):
    llm = engine_at(f"{failing}/silent/v1", timeout_s=0.3)
    with pytest.raises(BackendError, match=r"sent nothing for 0\.3 s .*--backend-timeout"):
        await run(llm, [{"role": "user", "content": "Hello"}])


async def test_a_refused_connection_is_a_plain_error():
    url = closed_port_url()
    with pytest.raises(BackendError, match=f"could not connect to the server at {url}"):
        await run(engine_at(url), [{"role": "user", "content": "Hello"}])
    from engine.remote import connect

    with pytest.raises(BackendError, match=f"could not connect to the server at {url}"):
        connect(RemoteConfig(url))
