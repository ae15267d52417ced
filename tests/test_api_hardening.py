"""The OpenAI API under attack, on real servers on 127.0.0.1: a corpus of malformed media of
every kind answers 400 (never 5xx) with messages that leak nothing; media URLs that bypass the
address policy, drip or inflate are refused; per-request processor options and literal
placeholder tokens are checked; and web pages cannot drive the server (JSON-only bodies, no
CORS grant unless configured, Host check against DNS rebinding, a loud warning when the API is
exposed without a key)."""

from __future__ import annotations

import base64
import dataclasses
import logging
import time
from types import SimpleNamespace

import brotli  # installed with gradio
import httpx
import pytest

import app as cli
from api import create_app
from api.guards import LOOPBACK_HOSTS, check_origins, host_name, is_loopback
from engine import AsyncLLM
from launch.web import guard_options, warn_if_exposed
from tests.api_fixtures import FailingEngine, running_server
from tests.helpers import assert_released, wait_idle
from tests.hostile_media import corpus
from tests.media_fixtures import (
    Route,
    VideoSpec,
    encode_image,
    encode_soundfile,
    encode_video,
    gradient,
    local_server,
    tone,
)

VL, AUDIO = "tiny-vl", "tiny-audio"
PNG = encode_image(gradient(56, 56), "PNG")
LEAKS = ("Traceback", " at 0x", "object at", "/tmp", "/usr", "/work", "site-packages", "File \"",
         "127.0.0.1", "169.254")


@dataclasses.dataclass
class Served:
    url: str
    llm: AsyncLLM
    model: str

    def post(self, path: str, body: dict, **kwargs) -> httpx.Response:
        return httpx.post(f"{self.url}/v1{path}", json=body, timeout=60, **kwargs)

    def chat(self, *parts: dict, text: str = "What is this?", **extra) -> httpx.Response:
        content = [*parts, {"type": "text", "text": text}]
        body = {"model": self.model, "messages": [{"role": "user", "content": content}],
                "max_tokens": 2, **extra}
        return self.post("/chat/completions", body)


@pytest.fixture(scope="module")
def vl(qwen2_vl_path):
    llm = AsyncLLM(qwen2_vl_path, max_model_len=2048)
    try:
        with running_server(create_app({VL: llm})) as url:
            yield Served(url, llm, VL)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def audio(qwen2_audio_path):
    llm = AsyncLLM(qwen2_audio_path, max_model_len=2048)
    try:
        with running_server(create_app({AUDIO: llm})) as url:
            yield Served(url, llm, AUDIO)
    finally:
        llm.shutdown()


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def part(modality: str, data: bytes) -> dict:
    if modality == "image":
        return image_part(data_url("image/png", data))
    if modality == "video":
        return {"type": "video_url", "video_url": {"url": data_url("video/mp4", data)}}
    return {"type": "input_audio",
            "input_audio": {"data": base64.b64encode(data).decode(), "format": "wav"}}


def error_of(response: httpx.Response, status: int) -> str:
    """The error message of a response that must have ``status``; checks it leaks nothing."""
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    for leak in LEAKS:
        assert leak not in message, message
    return message


def assert_still_serving(served: Served) -> None:
    if served.model == VL:
        reply = served.chat(image_part(data_url("image/png", PNG)))
    else:
        reply = served.chat(part("audio", encode_soundfile(tone(440, 16000, 0.5), 16000, "WAV")))
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 2


def assert_idle(served: Served) -> None:
    """The engine has nothing running and holds no KV block or encoder-cache reference."""
    deadline = time.monotonic() + 10
    while served.llm.stats()["requests_preprocessing"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    wait_idle(served.llm)
    assert_released(served.llm)


# Malformed media: always a 400 that names the item ------------------------------------------------


@pytest.mark.parametrize(("name", "modality", "data"), corpus(), ids=[c[0] for c in corpus()])
def test_malformed_media_is_a_400_never_a_5xx(request, name, modality, data) -> None:
    served = request.getfixturevalue("audio" if modality == "audio" else "vl")
    message = error_of(served.chat(part(modality, data)), 400)
    assert message.startswith(f"{modality} 1: "), message


def test_the_servers_still_serve_after_the_corpus(vl, audio) -> None:
    for served in (vl, audio):
        assert_still_serving(served)
        assert_idle(served)


@pytest.mark.parametrize(
    ("size", "status", "fragment"),
    [
        ((1, 1), 200, None),
        ((300, 1), 400, "aspect ratio 300.0, above the 200"),
        ((9000, 4000), 400, "image 1: 9000x4000 pixels exceeds the limit of 33177600 pixels"),
    ],
    ids=["1x1", "300x1", "9000x4000"],
)
def test_tiny_thin_and_huge_images(vl, size, status: int, fragment: str | None) -> None:
    from PIL import Image

    data = encode_image(Image.new("1", size), "PNG")  # 1-bit: small even when huge
    response = vl.chat(image_part(data_url("image/png", data)))
    if fragment is None:
        assert response.status_code == status, response.text
    else:
        assert fragment in error_of(response, status)


# Media URLs ---------------------------------------------------------------------------------------


@pytest.fixture
def server():
    with local_server({"/a.png": Route(body=PNG)}) as state:
        yield state


@pytest.mark.parametrize("url", [
    "http://2130706433:{port}/a.png",
    "http://[::ffff:127.0.0.1]:{port}/a.png",
    "http://[64:ff9b::7f00:1]:{port}/a.png",
    "http://localhost:{port}/a.png",
    "http://169.254.169.254/latest/meta-data/",
])
def test_private_media_urls_are_refused(vl, server, url: str) -> None:
    message = error_of(vl.chat(image_part(url.format(port=server.port))), 400)
    assert "image 1: URL host resolves to a private or loopback address" in message
    assert server.hosts == []


@pytest.fixture
def loopback_allowed(vl):
    """The engine's media limits with loopback allowed, for this test only."""
    processor = vl.llm.processor
    limits = processor.media_limits
    processor.media_limits = dataclasses.replace(
        limits, allow_private_networks=True, url_timeout_s=1.0, max_item_bytes=1 << 20
    )
    yield
    processor.media_limits = limits


def test_a_dripping_media_url_is_a_422_at_the_deadline(vl, server, loopback_allowed) -> None:
    server.routes["/drip"] = Route(body=PNG, drip_s=0.5)
    started = time.monotonic()
    message = error_of(vl.chat(image_part(server.url("/drip"))), 422)
    assert "image 1: download took longer than the limit of 1.0 s" in message
    assert time.monotonic() - started < 2.5
    assert vl.chat(image_part(server.url("/a.png"))).status_code == 200
    assert_idle(vl)


def test_a_compression_bomb_url_is_refused(vl, server, loopback_allowed) -> None:
    bomb = brotli.compress(b"\0" * (64 << 20), quality=1)
    server.routes["/bomb.png"] = Route(body=bomb, headers={"Content-Encoding": "br"})
    message = error_of(vl.chat(image_part(server.url("/bomb.png"))), 422)
    assert "content encoding 'br', which is not accepted" in message
    assert_idle(vl)


# Per-request options ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"min_pixels": 10**12}, "mm_processor_kwargs min_pixels=1000000000000 is not an "
                                 "integer in [784, 12845056]"),
        ({"max_pixels": 0}, "mm_processor_kwargs max_pixels=0 is not an integer in [784, "),
        ({"fps": 0}, "mm_processor_kwargs fps=0 is not a number in (0, 240]"),
        ({"fps": "fast"}, "mm_processor_kwargs fps='fast' is not a number"),
        ({"max_frames": 10**9}, "video 1: max_frames=1000000000 must be an integer between 1 "
                                "and 768"),
        ({"resize": True}, "unknown mm_processor_kwargs resize"),
    ],
)
def test_processor_options_out_of_range_are_400(vl, kwargs: dict, fragment: str) -> None:
    video = part("video", encode_video(VideoSpec(frames=4, width=56, height=56)))
    response = vl.chat(video, mm_processor_kwargs=kwargs)
    assert fragment in error_of(response, 400)


def test_processor_options_in_range_apply(vl) -> None:
    image = image_part(data_url("image/png", PNG))
    small = vl.chat(image, mm_processor_kwargs={"max_pixels": 784, "min_pixels": 784})
    large = vl.chat(image, mm_processor_kwargs={"min_pixels": 112 * 112})
    assert small.status_code == large.status_code == 200
    # 56x56: 4 embeddings by default; 1 at the smallest budget, 16 when upscaled.
    assert large.json()["usage"]["prompt_tokens"] - small.json()["usage"]["prompt_tokens"] == 15


# Literal placeholder tokens -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("with_image", "text", "fragment"),
    [
        (False, "<|vision_start|><|image_pad|><|vision_end|> what?",
         "1 image placeholder(s) but 0 image(s)"),
        (True, "and this <|image_pad|>", "2 image placeholder(s) but 1 image(s)"),
        (False, "<|video_pad|>" * 50, "50 video placeholder(s) but 0 video(s)"),
        (True, "<|vision_start|> stray start, no pad", None),
    ],
)
def test_placeholder_tokens_typed_in_the_text(vl, with_image, text, fragment) -> None:
    parts = [image_part(data_url("image/png", PNG))] if with_image else []
    response = vl.chat(*parts, text=text)
    if fragment is None:
        assert response.status_code == 200, response.text
    else:
        assert fragment in error_of(response, 400)


def test_placeholder_tokens_in_completions_and_audio(vl, audio) -> None:
    prompt = {"model": VL, "prompt": "<|vision_start|><|image_pad|><|vision_end|>", "max_tokens": 2}
    assert "1 image placeholder(s)" in error_of(vl.post("/completions", prompt), 400)
    assert "1 audio placeholder(s) but 0 audio clip(s)" in error_of(
        audio.chat(text="<|audio_bos|><|AUDIO|><|audio_eos|>"), 400
    )
    assert_idle(vl)
    assert_idle(audio)


# Web pages ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [None, "text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
     "multipart/form-data; boundary=x", "application/jsonp"],
)
def test_bodies_not_declared_json_are_refused(vl, content_type: str | None) -> None:
    steps = vl.llm.stats()["steps"]
    body = b'{"model": "tiny-vl", "prompt": "Hello", "max_tokens": 2}'
    headers = {"Content-Type": content_type} if content_type else {}
    for path in ("/completions", "/chat/completions"):
        response = httpx.post(f"{vl.url}/v1{path}", content=body, headers=headers)
        message = error_of(response, 415)
        assert "must be JSON sent with 'Content-Type: application/json'" in message
        assert response.json()["error"]["code"] == "unsupported_media_type"
    assert vl.llm.stats()["steps"] == steps  # nothing ran
    declared = httpx.post(f"{vl.url}/v1/completions", content=body,
                          headers={"Content-Type": "application/json; charset=utf-8"})
    assert declared.status_code == 200


def test_no_cors_grant_by_default(vl) -> None:
    preflight = httpx.options(f"{vl.url}/v1/chat/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    })
    assert "access-control-allow-origin" not in preflight.headers
    listed = httpx.get(f"{vl.url}/v1/models", headers={"Origin": "https://evil.example"})
    assert listed.status_code == 200 and "access-control-allow-origin" not in listed.headers


async def test_cors_only_for_configured_origins_and_only_on_the_api() -> None:
    app = create_app({"m": FailingEngine(RuntimeError())},
                     allowed_origins=["https://app.example"])

    @app.get("/elsewhere")
    async def elsewhere() -> dict:
        return {}

    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers":
           "content-type, authorization"}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
        granted = await http.options("/v1/chat/completions",
                                     headers={"Origin": "https://app.example", **ask})
        other = await http.options("/v1/chat/completions",
                                   headers={"Origin": "https://evil.example", **ask})
        outside = await http.options("/elsewhere", headers={"Origin": "https://app.example", **ask})
    assert granted.status_code == 200
    assert granted.headers["access-control-allow-origin"] == "https://app.example"
    assert "access-control-allow-origin" not in other.headers
    assert "access-control-allow-origin" not in outside.headers


@pytest.mark.parametrize("origin", ["https://app.example/path", "app.example", "ftp://x",
                                    "https://user@app.example", ""])
def test_bad_origins_are_refused(origin: str) -> None:
    with pytest.raises(ValueError, match="must be '\\*' or scheme://host"):
        check_origins([origin])
    assert cli.main(["--allowed-origins", origin, "--api-only"]) == 2


def test_host_check_defeats_dns_rebinding(vl) -> None:
    app = create_app({VL: vl.llm}, allowed_hosts=LOOPBACK_HOSTS)
    with running_server(app) as url:
        port = url.rsplit(":", 1)[1]
        for host, status in [("attacker.example", 400), (f"attacker.example:{port}", 400),
                             ("127.0.0.1.attacker.example", 400), (f"localhost:{port}", 200),
                             (f"127.0.0.1:{port}", 200), (f"[::1]:{port}", 200)]:
            response = httpx.get(f"{url}/v1/models", headers={"Host": host})
            assert response.status_code == status, host
            if status == 400:
                assert response.json()["error"]["code"] == "invalid_host"
    assert host_name("[::1]:8000") == "::1" and host_name("LOCALHOST.") == "localhost"


@pytest.mark.parametrize(
    ("host", "key", "share", "warned"),
    [
        ("0.0.0.0", None, False, True),
        ("::", None, False, True),
        ("192.168.1.20", None, False, True),
        ("0.0.0.0", "sesame", False, False),
        ("127.0.0.1", None, False, False),
        ("localhost", None, False, False),
        ("::1", None, False, False),
        ("127.0.0.1", None, True, True),
    ],
)
def test_exposed_api_without_a_key_is_warned_about(caplog, host, key, share, warned) -> None:
    with caplog.at_level(logging.WARNING, logger="mmserve"):
        assert warn_if_exposed(host, key, share=share) is warned
    assert ("WITHOUT an API key" in caplog.text) is warned
    args = SimpleNamespace(host=host, share=share, allowed_origins=[])
    hosts = guard_options(args)["allowed_hosts"]
    assert (hosts == LOOPBACK_HOSTS) is (is_loopback(host) and not share)
