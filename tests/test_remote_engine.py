"""The remote engine against our own API server on 127.0.0.1 (real HTTP, the demo lineup's
engines behind it): text, image, video and audio turns stream with what the in-process engine
would show, Stop aborts the server's request, a server that goes away mid-stream is a plain
error, and an API key is sent."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from contextlib import ExitStack

import pytest

from api import create_app
from api.responses import extension
from engine.metrics import RequestMetrics
from engine.outputs import CompletionOutput, PlaceholderInfo, RequestOutput
from engine.remote import BackendError, RemoteConfig, RequestRefusedError, connect
from engine.remote.stream import EXTENSION, StreamState
from tests.api_fixtures import running_server
from tests.helpers import assert_released, greedy, pace_steps
from tests.helpers import wait_idle_async as wait_idle
from tests.ui_fixtures import AUDIO, VL, demo_engines, demo_root
from ui import panels
from ui.demo import ensure_samples

GREEDY = greedy(8)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    with demo_engines(demo_root(tmp_path_factory)) as engines:
        yield engines


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    return ensure_samples(demo_root(tmp_path_factory))


@pytest.fixture(scope="module")
def url(engines):
    with running_server(create_app(engines)) as base:
        yield f"{base}/v1"


@pytest.fixture(scope="module")
def remote(url):
    return connect(RemoteConfig(url))


def ask(text: str, **media) -> list[dict]:
    parts = [{"type": kind, kind: data} for kind, data in media.items()]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


async def run(llm, messages, params=GREEDY, request_id=None) -> list:
    return [out async for out in llm.chat(messages, params, request_id)]


def test_the_servers_models_become_engines(remote, engines, url):
    assert list(remote) == list(engines)
    for name, llm in remote.items():
        local = engines[name].info
        info = llm.info
        assert (info.model, info.modalities, info.max_model_len, info.max_num_seqs) == (
            name, local.modalities, local.max_model_len, local.max_num_seqs)
        assert info.backend == url and llm.tokenizer is None


async def test_a_text_turn_streams_what_the_local_engine_writes(remote, engines):
    messages = ask("Tell me about the morning light.")
    outs = await run(remote[VL], messages)
    local = (await run(engines[VL], messages))[-1]
    assert len(outs) >= 3 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    final = outs[-1]
    assert final.outputs[0].text == local.outputs[0].text
    assert final.outputs[0].token_ids == local.outputs[0].token_ids
    assert final.outputs[0].finish_reason == "length"
    assert final.prompt_token_ids == local.prompt_token_ids
    assert final.num_cached_tokens is not None and final.unreported == {}
    m = final.metrics
    assert m.ttft > 0 and m.decode_time > 0 and m.prefill_chunks
    assert {"encode_request", "queue"} <= set(m.stages)
    assert remote[VL].stats()["requests_running"] == 0


async def test_an_image_turn_shows_the_servers_placeholders_and_caches(remote, samples):
    image = samples.image.read_bytes()
    # Long enough that the prefix cache's 16-token blocks cover the image on a repeat.
    question = "Describe this image: what can you see in it, on the left and on the right?"
    first = (await run(remote[VL], ask(question, image=image)))[-1]
    (ph,) = first.multi_modal_placeholders
    # 320x240 resized under the demo's max_pixels to 9x6 merged patches.
    assert (ph.modality, ph.length, ph.num_embeds, len(ph.identifier)) == ("image", 54, 54, 64)
    span = first.prompt_token_ids[ph.offset:ph.offset + ph.length]
    assert len(set(span)) == 1
    m = first.metrics
    assert {"media_load", "preprocess", "hashing"} <= set(m.stages) and m.encoder_calls == 1

    system = [{"role": "system", "content": "Be terse."}]
    again = (await run(remote[VL], system + ask(question, image=image)))[-1]
    (hit,) = again.multi_modal_placeholders
    assert hit.identifier == ph.identifier and hit.cache_hit is True
    assert again.metrics.encoder_cache_hits == 1
    assert panels.placeholder_table(again)["cache"].tolist() == [panels.HIT]
    assert f"image 1 · @{hit.offset} ×54 · 54 embeds · {hit.identifier[:8]} · hit" in (
        panels.placeholder_html(again, None))

    repeat = (await run(remote[VL], system + ask(question, image=image)))[-1]
    assert repeat.num_cached_tokens >= hit.offset + hit.length
    assert panels.cache_status(repeat, repeat.multi_modal_placeholders[0]) == panels.PREFIX


async def test_a_video_turn(remote, samples):
    final = (await run(remote[VL], ask("What happens?", video=samples.video.read_bytes())))[-1]
    assert [p.modality for p in final.multi_modal_placeholders] == ["video"] * 4
    assert panels.item_labels(final) == [f"video 1 · t{i}" for i in range(4)]


async def test_an_audio_turn(remote, samples):
    final = (await run(remote[AUDIO], ask("Transcribe.", audio=samples.audio)))[-1]  # a path
    (ph,) = final.multi_modal_placeholders
    assert ph.modality == "audio" and ph.length == ph.num_embeds > 0
    assert final.outputs[0].finish_reason == "length"


def test_placeholders_cross_the_wire_with_their_item_and_part():
    """What the API sends of a placeholder is what the remote engine reads back; an older
    server's reply without `item` and `part` reads as their defaults."""
    out = RequestOutput("r", None, [0] * 8, [CompletionOutput(0, "", [])], True, 0,
                        RequestMetrics(), [
        PlaceholderInfo("video", 1, 2, 2, "vid:t0", False, item="vid", part="frames 0-1 s"),
        PlaceholderInfo("audio", 3, 4, 3, "snd:w0", None, text_offsets=(1,), item="vid",
                        part="sound 0-2 s"),
        PlaceholderInfo("image", 7, 1, 1, "img", True, parts=(("base", 1),)),
    ])
    report = json.loads(json.dumps(extension(out)))

    def read(report: dict) -> list[PlaceholderInfo]:
        state = StreamState("r", 0.0, 0.0, ("video", "image"), from_mmserve=True)
        state.add({EXTENSION: report, "choices": []}, 0.0)
        return state.output(finished=True).multi_modal_placeholders

    assert read(report) == out.multi_modal_placeholders
    for p in report["placeholders"]:
        del p["item"], p["part"]
    assert read(report) == [dataclasses.replace(p, item=None, part="")
                            for p in out.multi_modal_placeholders]


async def test_stop_aborts_the_servers_request(remote, engines, samples, monkeypatch):
    server = engines[VL]
    await wait_idle(server)
    pace_steps(monkeypatch, server, 0.02)
    steps = server.stats()["steps"]
    long = greedy(2000)
    seen = []
    async for out in remote[VL].chat(ask("Go on.", image=samples.image.read_bytes()), long, "s"):
        seen.append(out)
        if len(seen) == 3:
            await remote[VL].abort("s")
    assert seen[-1].outputs[0].finish_reason == "abort"
    await wait_idle(server)
    assert server.stats()["steps"] - steps < 200, "the server's request ran on after Stop"
    assert_released(server)


async def test_a_server_that_goes_away_mid_stream(engines):
    server = engines[VL]
    await wait_idle(server)
    stack = ExitStack()
    base = stack.enter_context(running_server(create_app({VL: server})))
    llm = connect(RemoteConfig(f"{base}/v1"))[VL]
    long = greedy(3000)
    stream = llm.chat(ask("Go on and on."), long)
    with pytest.raises(BackendError, match="before the reply finished") as error:
        async for out in stream:
            if len(out.outputs[0].token_ids) >= 3 and stack is not None:
                await asyncio.to_thread(stack.close)  # stops the server, cutting the stream
                stack = None
    assert str(error.value).startswith(f"the server at {base}/v1 ")
    await wait_idle(server)  # the server aborted the orphaned request
    assert_released(server)
    with pytest.raises(BackendError, match=r"could not connect to the server at .*is it running"):
        await run(llm, ask("Hello?"))
    assert llm.stats()["requests_failed"] == 2


async def test_an_api_key_is_sent(engines):
    with running_server(create_app(engines, api_key="sesame")) as base:
        with pytest.raises(BackendError, match=r"refused the API key \(401: .*--backend-key"):
            connect(RemoteConfig(f"{base}/v1"))
        with pytest.raises(BackendError, match="refused the API key"):
            connect(RemoteConfig(f"{base}/v1", api_key="wrong"))
        llm = connect(RemoteConfig(f"{base}/v1", api_key="sesame"))[VL]
        final = (await run(llm, ask("Hi")))[-1]
        assert final.outputs[0].finish_reason == "length"


async def test_the_servers_refusals_are_the_engines_plain_errors(remote):
    broken = b"\x89PNG\r\n\x1a\n not really a png"
    with pytest.raises(RequestRefusedError, match="^image 1: could not decode the image"):
        await run(remote[VL], ask("What is it?", image=broken))
    with pytest.raises(ValueError, match="does not accept audio"):
        await run(remote[VL], ask("Listen.", audio=b"RIFF\x00\x00\x00\x00WAVEfmt "))
    final = (await run(remote[VL], ask("Still there?")))[-1]
    assert final.outputs[0].finish_reason == "length"
