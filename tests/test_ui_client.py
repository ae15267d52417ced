"""The served app through gradio_client: image, video and audio turns stream, and the panels'
data carries the expected placeholder ranges and the encoder-cache hit of a repeated image."""

from __future__ import annotations

import time

import pytest
from gradio_client import Client, handle_file
from gradio_client.client import Job
from gradio_client.exceptions import AppError

from launch.web import build_app
from tests.helpers import pace_steps
from tests.ui_fixtures import (
    AUDIO,
    NO_AUDIO,
    VL,
    demo_engines,
    demo_root,
    image_offset,
    running_app,
)
from ui.demo import ensure_samples

# Gradio's queue statistics use pandas options that pandas 3 deprecates; not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore::pandas.errors.Pandas4Warning")

# Outputs of /chat: composer, chatbot, placeholder strip, items table, cache, engine, timing.
CHATBOT, STRIP, ITEMS, CACHE, TIMING = 1, 2, 3, 4, 6


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = demo_root(tmp_path_factory)
    with demo_engines(root) as engines, running_app(build_app(engines)) as url:
        yield engines, ensure_samples(root), Client(url, verbose=False), url


def submit(client: Client, text: str, files, model=VL, system="", max_tokens=16) -> Job:
    """Start one /chat turn (a new conversation, greedy)."""
    message = {"text": text, "files": [handle_file(str(f)) for f in files]}
    return client.submit(message, [], model, system, 0.0, 1.0, max_tokens, -1, api_name="/chat")


def send(client: Client, text: str, files, **options) -> list:
    """Every streamed output of one /chat turn."""
    job = submit(client, text, files, **options)
    job.result(timeout=60)
    return job.outputs()


def items(outputs: list) -> list[dict]:
    table = outputs[-1][ITEMS]
    return [dict(zip(table["headers"], row, strict=True)) for row in table["data"]]


def reply(outputs: list) -> str:
    return "".join(part["text"] for part in outputs[-1][CHATBOT][-1]["content"])


def test_an_image_turn_streams_with_its_placeholder_range(served, monkeypatch):
    engines, samples, client, _ = served
    # Enough tokens, paced, that the coalesced stream arrives in several updates on a busy
    # machine and on a fast one (where the tiny model would finish between two updates).
    pace_steps(monkeypatch, engines[VL], 0.01)
    outputs = send(client, "Describe this image.", [samples.image], max_tokens=64)
    replies = [o[CHATBOT][-1] for o in outputs if o[CHATBOT][-1]["role"] == "assistant"]
    assert len(replies) >= 3, "the reply should arrive in several streamed updates"
    assert reply(outputs) and outputs[-1][CHATBOT][0]["content"][0]["type"] == "file"

    offset = image_offset(engines[VL].tokenizer)
    # 320x240 resized under the demo's max_pixels (64 merged 28x28 patches) to 252x168: 9x6.
    (item,) = items(outputs)
    assert item | {"hash": None} == {
        "item": "image 1", "modality": "image", "offset": offset, "length": 54, "embeds": 54,
        "hash": None, "cache": "miss",
    }
    assert f"image 1 · @{offset} ×54" in outputs[-1][STRIP]
    assert "TTFT" in outputs[-1][TIMING]


def test_the_gradio_api_works_with_every_other_input_defaulted(served):
    _, samples, client, _ = served
    message = {"text": "Describe this image.", "files": [handle_file(str(samples.image))]}
    result = client.predict(message, api_name="/chat")
    assert result[CHATBOT][-1]["role"] == "assistant" and result[CHATBOT][-1]["content"]
    (row,) = result[ITEMS]["data"]
    assert row[:2] == ["image 1", "image"]  # the default model: the first, which takes images
    assert client.predict({"text": "Hello", "files": []}, api_name="/chat")[CHATBOT][-1]


def test_a_video_turn_has_one_span_per_frame_group(served):
    _, samples, client, _ = served
    outputs = send(client, "What happens in this video?", [samples.video])
    rows = items(outputs)
    # 4 s sampled at 2 fps: 8 frames, 2 per temporal patch; each group 112x84 = 4x3 patches.
    assert [r["item"] for r in rows] == [f"video 1 · t{i}" for i in range(4)]
    assert [r["embeds"] for r in rows] == [12] * 4
    assert rows[1]["offset"] == rows[0]["offset"] + rows[0]["length"]
    assert reply(outputs)


def test_an_audio_turn(served):
    engines, samples, client, _ = served
    if AUDIO not in engines:
        pytest.skip(NO_AUDIO)
    outputs = send(client, "Transcribe this clip.", [samples.audio], model=AUDIO)
    (row,) = items(outputs)
    assert row["modality"] == "audio" and row["length"] == row["embeds"] > 0
    assert reply(outputs)


def test_a_repeated_image_is_an_encoder_cache_hit(served):
    _, samples, client, _ = served
    send(client, "Describe this image.", [samples.image])
    # A new system prompt changes the prefix: the image is looked up in the encoder cache.
    outputs = send(client, "Describe this image.", [samples.image], system="Be terse.")
    assert [r["cache"] for r in items(outputs)] == ["hit"]
    assert ">hit</span> image 1" in outputs[-1][CACHE]


def test_a_wrong_modality_is_reported_in_plain_words(served):
    _, samples, client, _ = served
    with pytest.raises(AppError, match="This model does not accept audio inputs"):
        send(client, "Listen.", [samples.audio])


def test_two_tabs_share_one_batch(served, monkeypatch):
    engines, samples, client, url = served
    # Paced like a real model (the tiny one decodes 100 tokens in about a second), so that on a
    # loaded machine the second tab's turn arrives while the first still runs.
    pace_steps(monkeypatch, engines[VL], 0.05)
    tabs = [client, Client(url, verbose=False)]  # two sessions, like two browser tabs
    jobs = [submit(tab, "Describe this image.", [samples.image], max_tokens=100) for tab in tabs]
    peak = 0
    while not all(job.done() for job in jobs):
        peak = max(peak, engines[VL].stats()["requests_running"])
        time.sleep(0.01)
    assert peak == 2, "both turns should run in the engine's batch at once"
    assert all(job.outputs()[-1][ITEMS]["data"] for job in jobs)
