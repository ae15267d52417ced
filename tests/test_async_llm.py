"""AsyncLLM: streaming deltas, abort and disconnect free resources, callers share one batch."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, AsyncLLM, SamplingParams
from tests.helpers import greedy, wait_idle_async

LONG = greedy(200)


@pytest.fixture(scope="module")
def engine(qwen2_path):
    llm = AsyncLLM(qwen2_path, max_model_len=512)
    yield llm
    llm.shutdown()



async def test_stream_deltas_join_to_the_final_text(engine, qwen2_path):
    params = greedy(40)
    deltas, token_deltas, outs = [], [], []
    async for out in engine.generate("Describe the image in detail.", params):
        deltas.append(out.outputs[0].delta_text)
        token_deltas += out.outputs[0].delta_token_ids
        outs.append(out)
    final = outs[-1].outputs[0]
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert "".join(deltas) == final.text
    assert token_deltas == final.token_ids and len(final.token_ids) == 40
    blocking = LLM(qwen2_path, max_model_len=512).generate("Describe the image in detail.", params)
    assert blocking[0].outputs[0].text == final.text


async def test_stop_string_never_leaks_into_a_delta(engine):
    params = greedy(40)
    text = [o async for o in engine.generate("Café naïve", params)][-1].outputs[0].text
    stop = text[10:14]
    params = greedy(40, stop=[stop])
    deltas = [o.outputs[0].delta_text async for o in engine.generate("Café naïve", params)]
    assert "".join(deltas) == text[: text.find(stop)]


async def test_abort_mid_stream_frees_every_block(engine):
    seen = 0
    final = None
    async for out in engine.generate("Hello", LONG, request_id="to-abort"):
        seen += 1
        if seen == 5:
            assert engine.engine.block_manager.num_used_blocks > 0
            await engine.abort("to-abort")
        final = out
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert len(final.outputs[0].token_ids) < 200
    stats = await wait_idle_async(engine)
    assert stats["kv_blocks_used"] == 0


async def test_consumer_that_goes_away_aborts_its_request(engine):
    async def consume():
        async for _ in engine.generate("Hello there", LONG):
            pass

    task = asyncio.create_task(consume())
    while engine.stats()["requests_running"] == 0:
        await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    stats = await wait_idle_async(engine)
    assert stats["kv_blocks_used"] == 0


async def test_concurrent_callers_share_batches(engine):
    params = greedy(30)
    before = engine.stats()["steps"]

    async def run(i):
        return [o async for o in engine.generate(f"prompt number {i}", params)][-1]

    outs = await asyncio.gather(*(run(i) for i in range(8)))
    steps = engine.stats()["steps"] - before
    assert all(len(o.outputs[0].token_ids) == 30 for o in outs)
    assert steps < 2 * 30, f"{steps} steps for 8 x 30 tokens: requests did not share batches"


async def test_duplicate_request_id_is_refused(engine):
    params = greedy(50)
    first = engine.generate("one", params, request_id="dup")
    await first.__anext__()
    with pytest.raises(ValueError, match="already in use"):
        async for _ in engine.generate("two", params, request_id="dup"):
            pass
    await first.aclose()
    await wait_idle_async(engine)


async def test_bad_prompt_fails_alone(engine):
    params = SamplingParams(max_tokens=10, temperature=0)
    good = asyncio.create_task(_collect(engine.generate("fine", params)))
    with pytest.raises(ValueError, match="max_model_len"):
        await _collect(engine.generate(list(range(1, 520)), params))
    assert (await good)[-1].outputs[0].finish_reason in ("length", "stop")


async def _collect(stream):
    return [o async for o in stream]


async def test_cancelled_abort_call_does_not_kill_the_engine(engine):
    """A caller cancelled while awaiting abort() must not break the engine thread."""
    params = greedy(300)
    stream = engine.generate("keep going", params, request_id="cancel-abort")
    await stream.__anext__()
    task = asyncio.create_task(engine.abort("cancel-abort"))
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await stream.aclose()
    await wait_idle_async(engine)
    out = [o async for o in engine.generate("still alive", SamplingParams(max_tokens=3))]
    assert out[-1].finished


async def test_stats_count_requests_still_preprocessing(engine, monkeypatch):
    import threading

    release = threading.Event()
    original = engine.processor.process

    def slow_process(parsed, media):
        release.wait(5)  # runs in a worker thread, like real media processing
        return original(parsed, media)

    monkeypatch.setattr(engine.processor, "process", slow_process)
    task = asyncio.create_task(_collect(engine.generate("slow", SamplingParams(max_tokens=2))))
    for _ in range(200):
        if engine.stats()["requests_preprocessing"] == 1:
            break
        await asyncio.sleep(0.01)
    assert engine.stats()["requests_preprocessing"] == 1
    release.set()
    assert (await task)[-1].finished
    assert engine.stats()["requests_preprocessing"] == 0
