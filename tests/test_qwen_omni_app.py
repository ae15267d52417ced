"""A real video file with a tone in its sound track (an H.264 + AAC mp4 written by FFmpeg's
libraries) reaches Qwen2.5-Omni's audio encoder through the app's chat handler and through the
OpenAI API: the placeholders show one video whose frames and sound interleave per 2 s, the
encoder statistics count the sound windows, and `use_audio_in_video` (vLLM's
mm_processor_kwargs field) turns the hearing off per request."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest

from api import create_app
from engine import AsyncLLM
from tests.api_fixtures import running_server
from tests.helpers import wait_idle, wait_idle_async
from tests.media_fixtures import VideoSpec, encode_video
from ui import panels
from ui.chat import Chat, ChatSettings

GREEDY = ChatSettings(temperature=0.0, max_tokens=4)
NAME = "tiny-omni"


def _frame(index: int) -> np.ndarray:
    return np.random.default_rng(index).integers(0, 256, (48, 64, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def movie(tmp_path_factory) -> bytes:
    """4 s of noise frames with a 523 Hz tone, 8 fps, AAC at 16 kHz."""
    return encode_video(VideoSpec(frames=32, fps=8, gop=8, audio_rate=16000, audio_freq=523.0,
                                  pattern=_frame))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from testing.qwen_omni import build_qwen_omni_model

    path = build_qwen_omni_model(tmp_path_factory.mktemp("ckpt") / "omni")
    llm = AsyncLLM(path, max_model_len=4096)
    yield llm
    llm.shutdown()


def assert_heard(placeholders) -> None:
    """One video item whose frames and sound alternate, the sound in 2 s windows."""
    kinds = [p.modality for p in sorted(placeholders, key=lambda p: p.offset)]
    assert kinds[:6] == ["video", "video", "audio", "video", "video", "audio"]
    assert len({p.item for p in placeholders}) == 1
    assert [p.part for p in placeholders if p.modality == "audio"][:2] == [
        "sound 0-2 s", "sound 2-4 s"]


async def test_the_chat_handler_hears_an_uploaded_video(engine, movie, tmp_path):
    upload = tmp_path / "tone.mp4"
    upload.write_bytes(movie)
    chat = Chat({NAME: engine}, update_interval=0.0)
    before = engine.stats()["encoder_cache_misses"]
    turn = {"text": "What do you hear?", "files": [str(upload)]}
    final = [u async for u in chat.respond(turn, [], NAME, GREEDY, "omni")][-1].output
    assert_heard(final.multi_modal_placeholders)
    sound = [p for p in final.multi_modal_placeholders if p.modality == "audio"]
    assert all(p.cache_hit is False and p.num_embeds > 0 for p in sound)
    # 4 temporal patches and 3 sound windows (two full, and the AAC tail's few frames).
    assert engine.stats()["encoder_cache_misses"] - before == 4 + len(sound)
    labels = panels.item_labels(final)
    assert labels[2] == "video 1 · sound 0-2 s" and labels[0] == "video 1 · frames 0-1 s"
    html = panels.placeholder_html(final, engine.tokenizer)
    assert html.count(panels.MODALITY_COLORS["audio"]) > 2  # sound chips between frame chips
    await wait_idle_async(engine)


def test_the_api_hears_a_video_and_takes_use_audio_in_video(engine, movie):
    url = "data:video/mp4;base64," + base64.b64encode(movie).decode()
    messages = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": url}},
        {"type": "text", "text": "What do you hear?"}]}]
    with running_server(create_app({NAME: engine})) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        heard = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2)
        seen = client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=2,
            extra_body={"mm_processor_kwargs": {"use_audio_in_video": False}})
        with pytest.raises(openai.BadRequestError, match="use_audio_in_video"):
            client.chat.completions.create(
                model=NAME, messages=messages, max_tokens=2,
                extra_body={"mm_processor_kwargs": {"use_audio_in_video": "yes"}})
    placeholders = heard.mmserve["placeholders"]
    kinds = [p["modality"] for p in sorted(placeholders, key=lambda p: p["offset"])]
    assert kinds[:3] == ["video", "video", "audio"]
    assert {p["item"] for p in placeholders} == {placeholders[0]["item"]}
    assert {p["modality"] for p in seen.mmserve["placeholders"]} == {"video"}
    assert seen.usage.prompt_tokens < heard.usage.prompt_tokens
    wait_idle(engine)
