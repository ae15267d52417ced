"""The app as a front end to a remote server (our own API server on 127.0.0.1, the demo lineup
behind it): turns through gradio_client with every input but the message defaulted, the
panels filled from the server's responses, Stop, and a server that went away reported as a
plain error with the chat left as it was."""

from __future__ import annotations

import dataclasses

import gradio as gr
import httpx
import pytest
from gradio_client import Client, handle_file

from api import create_app
from engine.remote import RemoteConfig, connect
from launch.web import build_app
from tests.api_fixtures import running_server
from tests.helpers import pace_steps, wait_idle
from tests.ui_fixtures import VL, demo_engines, demo_root, running_app
from ui.chat import EMPTY_DRAFT, Chat, ChatSettings
from ui.demo import ensure_samples

pytestmark = pytest.mark.filterwarnings("ignore::pandas.errors.Pandas4Warning")

# Outputs of /chat: composer, chatbot, placeholder strip, items table, cache, engine, timing.
CHATBOT, STRIP, ITEMS, CACHE, ENGINE, TIMING = 1, 2, 3, 4, 5, 6
GREEDY = ChatSettings(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with demo_engines(demo_root(tmp_path_factory)) as engines, running_server(
        create_app(engines)
    ) as url:
        yield engines, f"{url}/v1"


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    return ensure_samples(demo_root(tmp_path_factory))


@pytest.fixture(scope="module")
def front(server):
    _, url = server
    remote = connect(RemoteConfig(url))
    with running_app(build_app(remote)) as front_url:
        yield remote, front_url


def test_a_turn_through_the_gradio_api_with_defaults(front, samples):
    remote, front_url = front
    client = Client(front_url, verbose=False)
    message = {"text": "Describe this image.", "files": [handle_file(str(samples.image))]}
    result = client.predict(message, api_name="/chat")  # every other input defaulted
    reply = result[CHATBOT][-1]
    assert reply["role"] == "assistant" and reply["content"]
    table = result[ITEMS]
    (row,) = [dict(zip(table["headers"], r, strict=True)) for r in table["data"]]
    assert (row["item"], row["length"], row["embeds"], row["cache"]) == ("image 1", 54, 54, "miss")
    assert "text tokens" in result[STRIP] and "Token texts are not shown" in result[STRIP]
    assert "TTFT" in result[TIMING] and "media load" in result[TIMING]
    assert "Engine (remote)" in result[ENGINE] and "1 finished" in result[ENGINE]
    assert remote[VL].stats()["requests_running"] == 0


def test_the_front_end_serves_no_api_of_its_own(front):
    _, front_url = front
    assert httpx.get(f"{front_url}/v1/models").status_code == 404


async def test_stop_aborts_on_the_server(server, samples, monkeypatch):
    engines, url = server
    pace_steps(monkeypatch, engines[VL], 0.02)
    chat = Chat(connect(RemoteConfig(url)), update_interval=0.0)
    long = dataclasses.replace(GREEDY, max_tokens=3000)
    turn = {"text": "Go on.", "files": [str(samples.image)]}
    updates = []
    async for update in chat.respond(turn, [], VL, long, "s-stop"):
        updates.append(update)
        if update.output is not None and len(update.output.outputs[0].token_ids) >= 3:
            await chat.stop("s-stop")
    assert updates[-1].output.outputs[0].finish_reason == "abort"
    stats = wait_idle(engines[VL])
    assert stats["encoder_cache_referenced"] == 0 and stats["steps"] < 3000


async def test_a_server_that_went_away_is_a_plain_error_and_the_chat_stays(server, samples):
    engines, _ = server
    with running_server(create_app(engines)) as url:
        chat = Chat(connect(RemoteConfig(f"{url}/v1")), update_interval=0.0)
        first = [u async for u in chat.respond({"text": "Hi"}, [], VL, GREEDY, "s-gone")]
    history = first[-1].history
    turn = {"text": "Describe this image.", "files": [str(samples.image)]}
    updates = []
    with pytest.raises(gr.Error) as err:
        async for update in chat.respond(turn, history, VL, GREEDY, "s-gone"):
            updates.append(update)
    assert err.value.message.startswith(f"Could not connect to the server at {url}/v1")
    assert updates[-1].history == history and updates[-1].draft == turn
    assert updates[0].draft == EMPTY_DRAFT, "the turn was accepted before the server failed"
