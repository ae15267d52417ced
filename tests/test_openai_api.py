"""The OpenAI-compatible API, driven by the official openai client against a real server on
127.0.0.1: chat and completions (streaming or not), usage and prefix-cache hits, logprobs,
stop strings, every documented error status, disconnects that abort, batching, and media."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from api import create_app
from engine import AsyncLLM, EngineDeadError
from engine.media import MediaError, MediaFetchError
from testing import tiny
from tests.api_fixtures import FailingEngine, in_process_client, running_server
from tests.helpers import pace_steps
from tests.helpers import wait_idle_async as wait_idle
from tests.media_fixtures import (
    VideoSpec,
    encode_image,
    encode_soundfile,
    encode_video,
    gradient,
    marked_landscape,
    tone,
)

MODEL = "tiny-qwen2"
MAX_MODEL_LEN = 1024
MAX_BODY = 256 * 1024
GREEDY = {"temperature": 0, "max_tokens": 8, "extra_body": {"ignore_eos": True}}
HELLO = [{"role": "user", "content": "Describe the image in detail."}]
LONG_PROMPT = "The engine schedules requests, caches keys and values in blocks. " * 4
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def engine(qwen2_path):
    llm = AsyncLLM(qwen2_path, max_model_len=MAX_MODEL_LEN)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def base_url(engine):
    with running_server(create_app({MODEL: engine}, max_body_bytes=MAX_BODY)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=30)


def assert_still_serving(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, **GREEDY)
    assert reply.usage.completion_tokens == 8


def chat_prompt_tokens(engine: AsyncLLM, messages: list[dict]) -> int:
    tokenizer = engine.tokenizer
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


# ---- generation -------------------------------------------------------------------------


def test_models_lists_the_served_model(client):
    (model,) = client.models.list().data
    assert model.id == MODEL and model.max_model_len == MAX_MODEL_LEN
    extension = model.mmserve
    assert extension["modalities"] == [] and extension["max_num_seqs"] == 64
    # generation_config.json says do_sample false: a request that sets no sampling is greedy
    assert extension["sampling_defaults"] == {"temperature": 0.0}
    rows = {(r["component"], r["name"]): r for r in extension["checkpoint_settings"]}
    assert rows["model", "eos_token_ids"]["source"].startswith("generation_config.json")
    assert rows["model", "chat template"]["source"] == "chat_template.jinja"


def test_token_ids_are_returned_when_asked(client, engine):
    ids = {"return_token_ids": True, "ignore_eos": True}
    kwargs = {**GREEDY, "extra_body": ids}
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, **kwargs)
    prompt_ids = reply.prompt_token_ids
    assert len(prompt_ids) == reply.usage.prompt_tokens == chat_prompt_tokens(engine, HELLO)
    assert engine.tokenizer.decode(prompt_ids).startswith("<|im_start|>")
    output_ids = reply.choices[0].token_ids
    assert len(output_ids) == reply.usage.completion_tokens == 8
    # (the text leaves out a trailing partial character)
    assert engine.tokenizer.decode(output_ids).startswith(reply.choices[0].message.content)
    metrics = reply.mmserve["metrics"]
    assert reply.mmserve["placeholders"] == [] and metrics["ttft"] > 0
    assert metrics["prefill_chunks"][0][0] == len(prompt_ids)

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=HELLO, stream=True, stream_options={"include_usage": True},
        **kwargs,
    ))
    assert chunks[0].prompt_token_ids == prompt_ids
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    streamed = [t for c in chunks if c.choices for t in getattr(c.choices[0], "token_ids", [])]
    assert streamed == output_ids
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish[0].mmserve["metrics"]["decode_time"] > 0

    plain = client.chat.completions.create(model=MODEL, messages=HELLO, **GREEDY)
    assert getattr(plain, "prompt_token_ids", None) is None
    assert getattr(plain.choices[0], "token_ids", None) is None


def test_chat_streaming_matches_non_streaming(client, engine):
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, **GREEDY)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    usage = reply.usage
    assert usage.prompt_tokens == chat_prompt_tokens(engine, HELLO)
    assert (usage.completion_tokens, usage.total_tokens) == (8, usage.prompt_tokens + 8)

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=HELLO, stream=True, stream_options={"include_usage": True},
        **GREEDY,
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == usage.prompt_tokens


def test_completions_from_text_and_token_ids(client, engine):
    prompt = "The quick brown fox"
    ids = engine.tokenizer.encode(prompt)
    from_text = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
    from_ids = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert from_text.choices[0].text == from_ids.choices[0].text
    assert from_text.usage.prompt_tokens == from_ids.usage.prompt_tokens == len(ids)
    assert from_text.usage.completion_tokens == 8

    chunks = list(client.completions.create(
        model=MODEL, prompt=prompt, stream=True, stream_options={"include_usage": True}, **GREEDY
    ))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == from_text.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.total_tokens == len(ids) + 8


def test_repeated_long_prompt_reports_cached_tokens(client):
    first = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2)
    again = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2)
    prompt_tokens = again.usage.prompt_tokens
    assert first.usage.prompt_tokens == prompt_tokens > 32
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached == prompt_tokens - 1  # whole blocks, then the last one's tail: all but one


def test_chat_logprobs(client):
    kwargs = {**GREEDY, "max_tokens": 5, "logprobs": True, "top_logprobs": 3}
    reply = client.chat.completions.create(model=MODEL, messages=HELLO, **kwargs)
    content = reply.choices[0].logprobs.content
    assert len(content) == 5
    for item in content:
        top = item.top_logprobs
        assert len(top) == 3 and [t.logprob for t in top] == sorted(
            (t.logprob for t in top), reverse=True
        )
        assert item.token == top[0].token and item.logprob == pytest.approx(top[0].logprob)
        assert item.logprob <= 0 and item.bytes == list(item.token.encode())

    chunks = client.chat.completions.create(model=MODEL, messages=HELLO, stream=True, **kwargs)
    streamed = [i for c in chunks if c.choices and c.choices[0].logprobs
                for i in c.choices[0].logprobs.content]
    assert [i.token for i in streamed] == [i.token for i in content]


def test_completion_logprobs(client):
    reply = client.completions.create(model=MODEL, prompt="Hello", logprobs=2, **GREEDY)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)


def test_stop_strings_end_the_text(client):
    kwargs = {**GREEDY, "max_tokens": 16}
    text = client.completions.create(model=MODEL, prompt="Café naïve", **kwargs).choices[0].text
    assert len(text) > 8
    stop = text[5:8]
    stopped = client.completions.create(model=MODEL, prompt="Café naïve", stop=stop, **kwargs)
    assert stopped.choices[0].text == text[: text.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"

    full = client.chat.completions.create(model=MODEL, messages=HELLO, **kwargs)
    text = full.choices[0].message.content
    chunks = client.chat.completions.create(
        model=MODEL, messages=HELLO, stop=["\x00never", text[4:7]], stream=True, **kwargs
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text[: text.find(text[4:7])]


async def test_concurrent_streams_share_batches(base_url, engine):
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> int:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count to {i}."}], stream=True,
            stream_options={"include_usage": True}, max_tokens=16, extra_body={"ignore_eos": True},
        )
        return [c async for c in stream][-1].usage.completion_tokens

    steps = engine.stats()["steps"]
    tokens = await asyncio.gather(*(one(i) for i in range(16)))
    assert tokens == [16] * 16
    # One step advances every running request: 16 lone requests would need 256 steps.
    assert engine.stats()["steps"] - steps < sum(tokens) // 4
    await client.close()


# ---- disconnects ------------------------------------------------------------------------


# Steps are paced (2 ms each): on a fast machine the tiny model could otherwise run hundreds
# of steps before the client's timeout fires; paced, an aborted request stops within a few
# hundred steps while one left running takes all 900.


async def test_disconnect_mid_stream_aborts_the_request(base_url, engine, monkeypatch):
    pace_steps(monkeypatch, engine, 0.002)
    await wait_idle(engine)
    steps = engine.stats()["steps"]
    body = {"model": MODEL, "messages": HELLO, "stream": True, "max_tokens": 900,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as http, http.stream(
        "POST", f"{base_url}/v1/chat/completions", json=body
    ) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        while engine.stats()["requests_running"] == 0:  # stats lag the first chunk by a step
            await asyncio.sleep(0.01)
    stats = await wait_idle(engine)
    assert stats["steps"] - steps < 600, "the request ran on after the client left"


async def test_disconnect_while_waiting_for_a_full_reply_aborts(base_url, engine, monkeypatch):
    pace_steps(monkeypatch, engine, 0.002)
    await wait_idle(engine)
    steps = engine.stats()["steps"]
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 900, "ignore_eos": True}
    timeout = httpx.Timeout(30, read=0.5)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base_url}/v1/completions", json=body, timeout=timeout)
    stats = await wait_idle(engine)
    assert stats["steps"] - steps < 600, "the request ran on after the client left"


# ---- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "param", "fragments"),
    [
        ({"model": "gpt-4o"}, "model", ["'gpt-4o'", MODEL]),
        ({"temperature": "hot"}, "temperature", ["temperature"]),
        ({"top_p": 0}, None, ["top_p"]),
        ({"max_tokens": 0}, "max_tokens", ["max_tokens"]),
        ({"n": 17}, "n", ["n", "16"]),
        ({"presence_penalty": 2.5}, "presence_penalty", ["presence_penalty", "2"]),
        ({"top_logprobs": 2}, "top_logprobs", ["logprobs"]),
        ({"messages": []}, "messages", ["messages"]),
        ({"messages": [{"role": "user", "content": "hello " * 600}]}, None,
         ["max_model_len", str(MAX_MODEL_LEN)]),
        ({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ]}]}, None, ["does not accept image"]),
    ],
    ids=["unknown-model", "wrong-type", "out-of-range", "max-tokens", "n", "penalty",
         "top-logprobs-alone", "no-messages", "prompt-too-long", "image-to-text-model"],
)
def test_bad_chat_request_is_400_naming_the_problem(client, kwargs, param, fragments):
    request = {"model": MODEL, "messages": HELLO, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**request)
    error = info.value
    assert error.status_code == 400 and error.type == "invalid_request_error"
    assert error.param == param
    for fragment in fragments:
        assert fragment in error.body["message"], error.body
    assert_still_serving(client)


@pytest.mark.parametrize(
    ("prompt", "fragment"),
    [([1, 2, 10**6], "token ids"), (["one", "two"], "2 prompts"), ("", "empty")],
    ids=["token-out-of-vocab", "batch", "empty"],
)
def test_bad_completion_request_is_400(client, prompt, fragment):
    with pytest.raises(openai.BadRequestError, match=fragment):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert_still_serving(client)


def test_malformed_json_is_400(base_url, client):
    response = httpx.post(f"{base_url}/v1/chat/completions", content=b'{"model": ', headers=JSON)
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]
    assert_still_serving(client)


def test_body_over_the_limit_is_413(base_url, client):
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * MAX_BODY}]}
    data = json.dumps(big).encode()
    declared = httpx.post(f"{base_url}/v1/chat/completions", content=data, headers=JSON)
    chunked = httpx.post(
        f"{base_url}/v1/chat/completions", content=iter([data[:1000], data[1000:]]), headers=JSON
    )
    for response in (declared, chunked):
        assert response.status_code == 413
        error = response.json()["error"]
        assert str(MAX_BODY) in error["message"] and error["code"] == "request_too_large"
    assert_still_serving(client)


async def test_api_key_is_required_when_set(engine):
    app = create_app({MODEL: engine}, api_key="sesame")
    with pytest.raises(openai.AuthenticationError) as info:
        await in_process_client(app, api_key="wrong").models.list()
    assert info.value.status_code == 401 and "API key" in info.value.body["message"]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as http:
        missing = await http.post("http://in-process/v1/completions", json={})
    assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
    good = in_process_client(app, api_key="sesame")
    assert [m.id for m in (await good.models.list()).data] == [MODEL]
    reply = await good.completions.create(model=MODEL, prompt="Hi", **GREEDY)
    assert reply.usage.completion_tokens == 8


@pytest.mark.parametrize(
    ("error", "status", "kept", "hidden"),
    [
        (MediaFetchError("image 1: could not resolve the URL host"), 422, "resolve", None),
        (MediaError("image 1: could not decode the image (corrupted data)"), 400, "decode", None),
        (MediaError("request has 17 images; at most 16"), 400, "at most 16", None),
        (EngineDeadError("boom in /srv/secret.py"), 503, "not running", "secret"),
        (RuntimeError("KeyError in /srv/secret.py"), 500, "internal server error", "secret"),
    ],
    ids=["fetch-failed", "undecodable", "too-many-items", "engine-dead", "unexpected"],
)
async def test_engine_failures_map_to_statuses(error, status, kept, hidden):
    client = in_process_client(create_app({"failing": FailingEngine(error)}))
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as info:
            await client.chat.completions.create(model="failing", messages=HELLO, stream=stream)
        assert info.value.status_code == status
        message = info.value.body["message"]
        assert kept in message and (hidden is None or hidden not in message)


async def test_full_queue_or_dead_engine_is_503(qwen2_path):
    # One request runs at a time, so a second one waits; with max_waiting=1 a third is refused.
    serial = AsyncLLM(qwen2_path, max_model_len=MAX_MODEL_LEN, max_num_seqs=1)
    client = in_process_client(create_app({MODEL: serial}, max_waiting=1))
    request = {"model": MODEL, "prompt": "Hello", "extra_body": {"ignore_eos": True}}
    try:
        running = asyncio.create_task(client.completions.create(**request, max_tokens=900))
        while serial.stats()["requests_running"] == 0:
            await asyncio.sleep(0.01)
        waiting = asyncio.create_task(client.completions.create(**request, max_tokens=2))
        while serial.stats()["requests_waiting"] == 0:
            await asyncio.sleep(0.01)
        with pytest.raises(openai.InternalServerError) as info:
            await client.completions.create(**request, max_tokens=2)
        assert info.value.status_code == 503 and "max_waiting=1" in info.value.body["message"]
        assert info.value.response.headers["retry-after"] == "1"

        running.cancel()  # the app's handler is cancelled: its engine request is aborted
        with pytest.raises(asyncio.CancelledError):
            await running
        assert (await waiting).usage.completion_tokens == 2
        await wait_idle(serial)
        assert (await client.completions.create(**request, max_tokens=2)).usage.completion_tokens
    finally:
        serial.shutdown()
    with pytest.raises(openai.InternalServerError) as info:
        await client.completions.create(**request, max_tokens=2)
    assert info.value.status_code == 503 and "not running" in info.value.body["message"]


# ---- media (Qwen2-VL, Qwen2-Audio) --------------------------------------------------------


def _builder(name: str):
    if not hasattr(tiny, name):
        pytest.skip(f"testing.tiny.{name} does not exist yet (tiny multimodal checkpoints)")
    return getattr(tiny, name)


@contextmanager
def _served(name: str, checkpoint: Path) -> Iterator[openai.OpenAI]:
    llm = AsyncLLM(checkpoint, max_model_len=2048)
    try:
        with running_server(create_app({name: llm})) as url:
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def vl_client(tmp_path_factory):
    build = _builder("build_qwen2_vl_model")
    path = tmp_path_factory.mktemp("ckpt") / "qwen2_vl"
    with _served("tiny-vl", build(path, variant="qwen2_vl")) as client:
        yield client


@pytest.fixture(scope="module")
def audio_client(tmp_path_factory):
    build = _builder("build_qwen2_audio_model")
    path = tmp_path_factory.mktemp("ckpt") / "qwen2_audio"
    with _served("tiny-audio", build(path)) as client:
        yield client


def _data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _image_url() -> str:
    return _data_url("image/png", encode_image(gradient(56, 56), "PNG"))


def _video_url() -> str:
    return _data_url("video/mp4", encode_video(VideoSpec(frames=4, width=56, height=56)))


def _wav_base64() -> str:
    return base64.b64encode(encode_soundfile(tone(440, 16000, 0.5), 16000, "WAV")).decode()


def _ask(part: dict) -> list[dict]:
    return [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]


def _image_part() -> dict:
    return {"type": "image_url", "image_url": {"url": _image_url()}}


MEDIA_PARTS = {
    "image": ("vl_client", _image_part),
    "video": ("vl_client", lambda: {"type": "video_url", "video_url": {"url": _video_url()}}),
    "audio": ("audio_client", lambda: {
        "type": "input_audio", "input_audio": {"data": _wav_base64(), "format": "wav"},
    }),
}


class TestMedia:
    """Media requests on the tiny multimodal models (skipped until their builders exist)."""

    @pytest.mark.parametrize("kind", sorted(MEDIA_PARTS))
    def test_media_chat_streams_and_replies(self, request, kind):
        fixture, part = MEDIA_PARTS[kind]
        client = request.getfixturevalue(fixture)
        model = client.models.list().data[0].id
        messages = _ask(part())
        reply = client.chat.completions.create(model=model, messages=messages, **GREEDY)
        assert reply.usage.completion_tokens == 8 and reply.usage.prompt_tokens > 8
        chunks = list(client.chat.completions.create(
            model=model, messages=messages, stream=True, **GREEDY
        ))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == reply.choices[0].message.content

    def test_repeated_image_request_reports_cached_tokens(self, vl_client):
        messages = _ask(_image_part())
        vl_client.chat.completions.create(model="tiny-vl", messages=messages, max_tokens=2)
        again = vl_client.chat.completions.create(model="tiny-vl", messages=messages, max_tokens=2)
        assert again.usage.prompt_tokens_details.cached_tokens >= 16

    def test_placeholders_and_encoder_cache_outcome_are_reported(self, vl_client):
        # An image no other test sends: its first request misses the encoder cache.
        url = _data_url("image/png", encode_image(marked_landscape().resize((56, 56)), "PNG"))
        part = {"type": "image_url", "image_url": {"url": url}}

        def placeholders(system: str) -> tuple[list[dict], list[int]]:
            messages = [{"role": "system", "content": system}, *_ask(part)]
            reply = vl_client.chat.completions.create(
                model="tiny-vl", messages=messages, max_tokens=2,
                extra_body={"return_token_ids": True},
            )
            return reply.mmserve["placeholders"], reply.prompt_token_ids

        (first,), ids = placeholders("One.")
        # A 56x56 image: 4x4 patches merged 2x2, 4 embeddings of the image pad token.
        assert first["modality"] == "image" and first["length"] == first["num_embeds"] == 4
        assert first["text_offsets"] == []  # every position of a Qwen2-VL span is embedded
        span = ids[first["offset"]:first["offset"] + first["length"]]
        assert len(set(span)) == 1 and ids[first["offset"] - 1] != span[0]
        assert first["cache_hit"] is False and len(first["identifier"]) == 64
        (again,), _ = placeholders("Two.")  # another prefix: the encoder cache is asked
        assert again["cache_hit"] is True and again["identifier"] == first["identifier"]

    def test_models_say_which_media_they_take(self, vl_client, audio_client):
        assert vl_client.models.list().data[0].mmserve["modalities"] == ["image", "video"]
        assert audio_client.models.list().data[0].mmserve["modalities"] == ["audio"]

    @pytest.mark.parametrize(
        ("url", "error", "fragment"),
        [
            ("data:image/png;base64,bm90IGFuIGltYWdl", openai.BadRequestError, "decode"),
            ("http://unreachable.invalid/cat.png", openai.UnprocessableEntityError, "resolve"),
        ],
        ids=["undecodable", "unreachable"],
    )
    def test_bad_image_url(self, vl_client, url, error, fragment):
        part = {"type": "image_url", "image_url": {"url": url}}
        with pytest.raises(error, match=fragment):
            vl_client.chat.completions.create(model="tiny-vl", messages=_ask(part))
        assert vl_client.chat.completions.create(
            model="tiny-vl", messages=_ask(_image_part()), max_tokens=2
        ).usage.completion_tokens == 2

    def test_audio_sent_to_the_vision_model_is_400(self, vl_client):
        with pytest.raises(openai.BadRequestError, match="does not accept audio"):
            vl_client.chat.completions.create(
                model="tiny-vl", messages=_ask(MEDIA_PARTS["audio"][1]())
            )
