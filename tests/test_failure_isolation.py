"""One bad request never fails its neighbours: a media item whose encoder raises fails its own
request (the error names the item), while the requests batched with it in the step compute their
chunk again and finish with the tokens they produce alone; a failure of the decoder's forward
still fails the whole step; a request whose preprocessing raises fails alone. Every case ends
with no KV block and no encoder-cache reference held."""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch

from api import create_app
from engine import LLM, AsyncLLM
from engine.encoder_cache import EncoderCacheManager
from engine.model_runner import EncoderItemsFailed
from engine.request import Request
from tests.api_fixtures import running_server
from tests.helpers import (
    assert_released,
    engine_idle,
    greedy,
    pace_steps,
    process_chat,
    random_image,
    user,
    wait_idle_async,
)

N = 8
GREEDY = greedy(N)

GOOD = user(random_image(64, 64, 1), "Describe the image in detail.")
BAD = user(random_image(56, 84, 2), "What is in this picture?")
TEXT = user("Hello there, how are you today?")


@pytest.fixture(scope="module")
def reference(qwen2_vl_path):
    """Each conversation's greedy tokens, run alone on an engine of its own."""
    ref = LLM(qwen2_vl_path, max_model_len=1024)
    return lambda messages: ref.chat(messages, GREEDY)[0].outputs[0].token_ids


@pytest.fixture
def llm(qwen2_vl_path):
    """A fresh engine: no prefix-cache or encoder-cache entry from another test."""
    return LLM(qwen2_vl_path, max_model_len=1024)


def pixels(llm, messages, index: int = 0) -> torch.Tensor:
    """The processed pixel values of the conversation's image `index`."""
    proc, _ = process_chat(llm, messages)
    return [f for f in proc.mm_features if f.modality == "image"][index].data["pixel_values"]


def poison(monkeypatch, llm, bad: torch.Tensor, short: bool = False) -> list[int]:
    """Make the model's encoder raise on any batch holding `bad` (or, if `short`, return one
    embedding too few for it); returns the sizes of the batches it is called with."""
    model = llm.engine.runner.model
    encode = model.encode
    calls: list[int] = []

    def encode_or_raise(items):
        calls.append(len(items))
        hit = [torch.equal(d["pixel_values"], bad) for _, d in items]
        if any(hit) and not short:
            raise RuntimeError("poisoned pixels")
        return [e[..., :-1, :] if h else e for e, h in zip(encode(items), hit, strict=True)]

    monkeypatch.setattr(model, "encode", encode_or_raise)
    return calls


def record_steps(monkeypatch, llm) -> list[tuple[int, str]]:
    """(chunks, outcome) of every step the runner executes: "ok", "items" or "error"."""
    runner = llm.engine.runner
    execute = runner.execute
    steps: list[tuple[int, str]] = []

    def recorded(out):
        try:
            result = execute(out)
        except EncoderItemsFailed:
            steps.append((len(out.chunks), "items"))
            raise
        except Exception:
            steps.append((len(out.chunks), "error"))
            raise
        steps.append((len(out.chunks), "ok"))
        return result

    monkeypatch.setattr(runner, "execute", recorded)
    return steps


def add(llm, messages) -> Request:
    proc, _ = process_chat(llm, messages)
    req = llm.engine.make_request(proc, GREEDY)
    llm.engine.add_request(req)
    return req


def drain(llm) -> dict:
    """Step until nothing is left, checking the bookkeeping after each step; the finished
    outputs by request id."""
    done = {}
    for _ in range(100):
        for out in llm.engine.step():
            if out.finished:
                done[out.request_id] = out
        llm.engine.check_integrity()
        if not llm.engine.has_unfinished():
            return done
    raise AssertionError("the requests made no progress")


def assert_failed_on(out, fragment: str, cause: str = "RuntimeError: poisoned pixels") -> None:
    assert out.finished and out.outputs[0].finish_reason == "error"
    assert out.outputs[0].token_ids == []
    assert fragment in out.error and cause in out.error, out.error


def test_a_poisoned_image_fails_alone_in_its_step(llm, reference, monkeypatch):
    expected = {"good": reference(GOOD), "text": reference(TEXT), "bad": reference(BAD)}
    calls = poison(monkeypatch, llm, pixels(llm, BAD))
    steps = record_steps(monkeypatch, llm)
    good, bad, text = add(llm, GOOD), add(llm, BAD), add(llm, TEXT)

    (failed,) = llm.engine.step()
    assert steps == [(3, "items")] and calls == [2, 1, 1]  # the batch, then each item alone
    assert failed.request_id == bad.request_id
    assert_failed_on(failed, "image item 0")
    # The survivors computed nothing: counters unmoved, no block registered in the prefix
    # cache before its KV was written, the good image's embeddings kept for the next step.
    assert good.num_computed_tokens == text.num_computed_tokens == 0
    assert llm.stats()["kv_blocks_cached"] == 0
    assert llm.stats()["step_errors"] == 1
    llm.engine.check_integrity()

    done = drain(llm)
    assert calls == [2, 1, 1], "the good image was encoded again"
    assert done[good.request_id].outputs[0].token_ids == expected["good"]
    assert done[text.request_id].outputs[0].token_ids == expected["text"]
    assert set(done) == {good.request_id, text.request_id}
    assert_released(llm)
    assert engine_idle(llm.stats())

    # The failed item left no cache entry behind: once the encoder works, it is encoded afresh.
    monkeypatch.undo()
    assert llm.chat(BAD, GREEDY)[0].outputs[0].token_ids == expected["bad"]
    assert_released(llm)


def test_the_retry_blames_an_item_that_is_not_first(llm, reference, monkeypatch):
    two = user("Compare", random_image(64, 64, 3), "with", random_image(56, 84, 2), "please.")
    expected = {"good": reference(GOOD), "text": reference(TEXT)}
    calls = poison(monkeypatch, llm, pixels(llm, two, index=1))
    steps = record_steps(monkeypatch, llm)
    text = add(llm, TEXT)
    llm.engine.step()
    llm.engine.step()  # the text request is decoding now
    good, broken = add(llm, GOOD), add(llm, two)

    (failed,) = llm.engine.step()
    assert steps[-1] == (3, "items") and calls == [3, 1, 1, 1]
    assert failed.request_id == broken.request_id
    assert_failed_on(failed, "image item 1")

    done = drain(llm)
    assert done[good.request_id].outputs[0].token_ids == expected["good"]
    assert done[text.request_id].outputs[0].token_ids == expected["text"]
    assert_released(llm)


def test_an_embedding_count_mismatch_is_blamed_on_its_item(llm, reference, monkeypatch):
    calls = poison(monkeypatch, llm, pixels(llm, BAD), short=True)
    good, bad, text = add(llm, GOOD), add(llm, BAD), add(llm, TEXT)
    (failed,) = llm.engine.step()
    assert calls == [2]  # the batch did not raise: nothing to encode again
    assert failed.request_id == bad.request_id
    n = bad.mm_features[0].placeholder.num_embeds
    assert_failed_on(failed, "image item 0",
                     f"encoder returned {n - 1} embeddings but its placeholder has {n} embed")
    done = drain(llm)
    assert done[good.request_id].outputs[0].token_ids == reference(GOOD)
    assert done[text.request_id].outputs[0].token_ids == reference(TEXT)
    assert_released(llm)


def test_discarding_an_entry_frees_its_space_for_everyone():
    cache = EncoderCacheManager(100)
    a, b = (Request(r, [1, 2], GREEDY, frozenset(), 4) for r in "ab")
    cache.allocate(a, "held", 30)
    cache.allocate(b, "unheld", 20)
    cache.release(b, "unheld")
    cache.discard("held")
    cache.discard("unheld")
    cache.discard("unknown")
    assert (cache.free, cache.reclaimable, cache.cached) == (100, 100, {})
    assert not cache.lookup(a, "held") and not cache.lookup(b, "unheld")
    cache.check_integrity([a, b])


def test_a_decoder_failure_fails_the_step_without_leaking(llm, reference, monkeypatch):
    model = llm.engine.runner.model
    forward = model.forward
    raised = []

    def forward_once(*args, **kwargs):
        if not raised:
            raised.append(True)
            raise RuntimeError("decoder broke")
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward_once)
    good, text = add(llm, GOOD), add(llm, TEXT)
    outs = {o.request_id: o for o in llm.engine.step()}
    assert set(outs) == {good.request_id, text.request_id}
    for out in outs.values():
        assert out.outputs[0].finish_reason == "error" and "decoder broke" in out.error
    stats = llm.stats()
    assert stats["step_errors"] == 1 and stats["kv_blocks_cached"] == 0
    assert_released(llm)
    assert engine_idle(stats)

    outs = llm.chat([GOOD, TEXT], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [reference(GOOD), reference(TEXT)]
    assert_released(llm)


# ---- over HTTP --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(qwen2_vl_path):
    llm = AsyncLLM(qwen2_vl_path, max_model_len=1024)
    try:
        with running_server(create_app({"tiny-vl": llm})) as url:
            yield llm, url
    finally:
        llm.shutdown()


def _image_url(seed: int) -> str:
    import base64
    import io

    buffer = io.BytesIO()
    random_image(56, 56, seed).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _ask(url: str | None) -> list[dict]:
    content = [{"type": "text", "text": "What is this?"}]
    if url is not None:
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    return [{"role": "user", "content": content}]


async def _concurrent_with(llm, url, poisoned: list[dict]):
    """Start a text and an image request (32 tokens each), send `poisoned` once both run;
    returns the good replies' texts, their texts when sent alone, and the poisoned error."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    kwargs = {"model": "tiny-vl", "temperature": 0, "max_tokens": 32,
              "extra_body": {"ignore_eos": True}}
    goods = [_ask(None), _ask(_image_url(11))]

    async def answer(messages):
        reply = await client.chat.completions.create(messages=messages, **kwargs)
        assert reply.usage.completion_tokens == 32
        return reply.choices[0].message.content

    alone = [await answer(m) for m in goods]
    tasks = [asyncio.create_task(answer(m)) for m in goods]
    while llm.stats()["requests_running"] < 2:
        await asyncio.sleep(0.005)
    with pytest.raises(openai.InternalServerError) as error:
        await client.chat.completions.create(messages=poisoned, **kwargs)
    together = await asyncio.gather(*tasks)
    await client.close()
    return together, alone, error.value


async def test_a_poisoned_request_over_http_fails_alone(served, monkeypatch):
    llm, url = served
    poisoned = _ask(_image_url(12))
    poison(monkeypatch, llm, pixels(llm, poisoned))
    steps = record_steps(monkeypatch, llm)
    pace_steps(monkeypatch, llm, 0.02)
    together, alone, error = await _concurrent_with(llm, url, poisoned)
    assert error.status_code == 500
    assert together == alone
    assert (3, "items") in steps  # the poisoned prefill was batched with both decodes
    stats = await wait_idle_async(llm)
    assert stats["encoder_cache_referenced"] == 0
    llm.engine.check_integrity()  # idle: the engine thread is waiting for work


async def test_a_request_whose_preprocessing_raises_fails_alone(served, monkeypatch):
    llm, url = served
    poisoned = _ask(_image_url(13))
    bad = pixels(llm, poisoned)
    mm_processor = llm.processor.mm_processor
    process = mm_processor.process

    def process_or_raise(token_ids, media, mm_kwargs):
        out = process(token_ids, media, mm_kwargs)
        if any(torch.equal(f.data["pixel_values"], bad) for f in out.mm_features):
            raise RuntimeError("the processor broke on this image")
        return out

    monkeypatch.setattr(mm_processor, "process", process_or_raise)
    pace_steps(monkeypatch, llm, 0.02)
    errors = llm.stats()["step_errors"]
    together, alone, error = await _concurrent_with(llm, url, poisoned)
    assert error.status_code == 500
    assert together == alone
    stats = await wait_idle_async(llm)
    assert stats["requests_preprocessing"] == 0 and stats["step_errors"] == errors
