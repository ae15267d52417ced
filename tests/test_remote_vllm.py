"""The remote engine against a stand-in that answers the way vLLM does: its model list, its
token ids (`prompt_token_ids` in the first chunk, `token_ids` per chunk), its usage chunk and
its cached-token reporting, media spans found from the prompt's pad-token runs (the pad token
named by /tokenize), vLLM's error bodies, and Stop closing the stream."""

from __future__ import annotations

import asyncio

import pytest

from engine import SamplingParams
from engine.outputs import PlaceholderInfo
from engine.remote import ModelCard, RemoteConfig, RemoteEngine, RequestRefusedError, connect
from engine.remote.stream import NO_CACHED_TOKENS, NO_ENCODER_CACHE, NO_SERVER_TIMING
from tests.api_fixtures import running_server
from tests.media_fixtures import encode_image, gradient
from tests.vllm_standin import IMAGE_PAD, IMAGE_TOKENS, MAX_MODEL_LEN, MODEL, StandIn
from ui import panels
from ui.timing import timing_html

GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.fixture
def standin():
    return StandIn()


@pytest.fixture
def url(standin):
    with running_server(standin.app()) as base:
        yield f"{base}/v1"


@pytest.fixture
def llm(url) -> RemoteEngine:
    (engine,) = connect(RemoteConfig(url)).values()
    return engine


def image_turn(text: str = "What is this? Describe every part of it in a few words.") -> list[dict]:
    png = encode_image(gradient(32, 32), "PNG")
    return [{"role": "user", "content": [{"type": "image", "image": png},
                                         {"type": "text", "text": text}]}]


async def outputs(llm: RemoteEngine, messages: list[dict], params=GREEDY) -> list:
    return [out async for out in llm.chat(messages, params)]


def test_the_model_list_names_the_model_and_its_context(llm, url):
    info = llm.info
    assert (info.model, info.max_model_len, info.backend) == (MODEL, MAX_MODEL_LEN, url)
    assert info.modalities is None, "vLLM does not say which media a model takes"
    assert info.max_num_seqs == RemoteConfig(url).max_num_seqs


async def test_the_request_is_what_vllm_expects(llm, standin):
    await outputs(llm, image_turn(), SamplingParams(max_tokens=6, temperature=0.5, top_k=5))
    (body,) = standin.requests
    assert body["model"] == MODEL and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["return_token_ids"] is True
    assert (body["max_tokens"], body["temperature"], body["top_k"]) == (6, 0.5, 5)
    assert "min_p" not in body and "seed" not in body, "defaults are left to the server"
    image, text = body["messages"][0]["content"]
    assert image["type"] == "image_url"
    assert image["image_url"]["url"].startswith("data:image/png;base64,iVBORw0KGgo")
    assert text["text"].startswith("What is this?")


async def test_token_ids_usage_and_pad_token_runs_are_read(llm, standin):
    outs = await outputs(llm, image_turn())
    final = outs[-1]
    assert len(outs) == GREEDY.max_tokens + 1, "one output per token, then the final one"
    assert [o.finished for o in outs] == [False] * GREEDY.max_tokens + [True]
    texts = [o.outputs[0].text for o in outs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert final.outputs[0].text == "A red ball rolls across the"
    assert final.outputs[0].token_ids == [2000 + i for i in range(6)]
    assert final.outputs[0].finish_reason == "length"

    prompt = final.prompt_token_ids
    assert final.num_prompt_tokens == len(prompt) > IMAGE_TOKENS
    offset = prompt.index(IMAGE_PAD)
    expected = [PlaceholderInfo("image", offset, IMAGE_TOKENS, IMAGE_TOKENS, None, None)]
    assert final.multi_modal_placeholders == expected
    assert outs[0].multi_modal_placeholders == expected, "the spans are known from the start"

    # vLLM leaves a count of 0 out: "not reported", and the panel says what to check.
    assert final.num_cached_tokens is None
    assert final.unreported == {"cached_tokens": NO_CACHED_TOKENS,
                                "encoder_cache": NO_ENCODER_CACHE,
                                "server_timing": NO_SERVER_TIMING}
    m = final.metrics
    assert 0 < m.ttft and m.decode_time > 0 and set(m.stages) == {"encode_request"}

    again = (await outputs(llm, image_turn()))[-1]
    assert again.num_cached_tokens == len(prompt) // 16 * 16 > offset + IMAGE_TOKENS
    assert panels.cache_status(again, again.multi_modal_placeholders[0]) == panels.PREFIX


async def test_without_prompt_tokens_details_cached_tokens_stay_unknown(url, standin):
    standin.prompt_tokens_details = False
    (llm,) = connect(RemoteConfig(url)).values()
    for _ in range(2):
        final = (await outputs(llm, image_turn()))[-1]
        assert final.num_cached_tokens is None
    assert "--enable-prompt-tokens-details" in panels.cache_html(final)
    assert "--enable-cache-report" in panels.cache_html(final)


async def test_without_token_ids_the_spans_are_not_located(url, standin):
    (llm,) = connect(RemoteConfig(url, return_token_ids=False)).values()
    final = (await outputs(llm, image_turn()))[-1]
    assert "return_token_ids" not in standin.requests[0]
    assert final.prompt_token_ids == [] and final.multi_modal_placeholders == []
    assert final.num_prompt_tokens == 3 + IMAGE_TOKENS + 2 + 12 + 5, "from usage"
    assert final.outputs[0].num_tokens == GREEDY.max_tokens and not final.outputs[0].token_ids
    assert "0.10.2" in final.unreported["prompt_token_ids"]
    assert "cannot be located" in final.unreported["placeholders"]
    strip = panels.placeholder_html(final, llm.tokenizer)
    assert "cannot be located" in strip and "? prompt tokens" not in strip
    assert "decode" in timing_html(final) and "tok/s" in timing_html(final)


async def test_the_panels_say_what_the_server_did_not_report(llm):
    final = (await outputs(llm, image_turn()))[-1]
    (row,) = panels.placeholder_table(final).to_dict("records")
    assert row["item"] == "image 1" and row["hash"] == "—" and row["cache"] == panels.UNKNOWN
    strip = panels.placeholder_html(final, llm.tokenizer)
    assert f"image 1 · @{row['offset']} ×{IMAGE_TOKENS}" in strip
    assert f"{row['offset']} text tokens" in strip and "Token texts are not shown" in strip
    cache = panels.cache_html(final)
    assert "encoder-cache outcomes" in cache and "not reported" in cache
    timing = timing_html(final)
    assert "does not report its stages" in timing and "TTFT" in timing
    engine = panels.engine_html(llm.stats())
    assert "1 finished" in engine and "not visible over the OpenAI API" in engine


async def test_vllm_error_bodies_become_plain_errors(url, standin):
    llm = RemoteEngine(RemoteConfig(url), ModelCard("not-served"))
    with pytest.raises(RequestRefusedError, match="The model `not-served` does not exist.") as e:
        await outputs(llm, image_turn())
    assert e.value.status == 404
    standin.legacy_errors = True  # vLLM before 0.10
    with pytest.raises(ValueError, match="^The model `not-served` does not exist.$"):
        await outputs(llm, image_turn())
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {
        "data": "UklGRg==", "format": "wav"}}]}]
    (served,) = connect(RemoteConfig(url)).values()
    with pytest.raises(ValueError, match="Only image_url parts"):
        await outputs(served, audio)
    assert llm.stats()["requests_failed"] == 2 and llm.stats()["requests_running"] == 0
    with pytest.raises(ValueError, match="does not serve 'nope'; it serves: " + MODEL):
        connect(RemoteConfig(url), ["nope"])


async def test_stop_closes_the_stream(llm, standin):
    standin.token_delay_s = 0.05
    stream = llm.chat(image_turn(), SamplingParams(max_tokens=1000, temperature=0), "r-stop")
    seen = []
    async for out in stream:
        seen.append(out)
        if len(seen) == 3:
            await llm.abort("r-stop")
    final = seen[-1]
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert len(final.outputs[0].token_ids) < 20
    for _ in range(100):  # the server notices the closed connection on its next write
        if standin.disconnected:
            break
        await asyncio.sleep(0.02)
    assert standin.disconnected == [0] and standin.finished == []
    assert llm.stats()["requests_running"] == 0
