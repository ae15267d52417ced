"""Test helpers shared by several modules: serving an app in a thread, waiting for an engine
to go idle or pacing its steps, checking that a request released everything, counting encoder
forwards, processing a chat the way the engine does, greedy sampling parameters, transformers'
greedy reference, driving a model's forward directly, a random walk through a grammar."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine.sampling_params import SamplingParams
from testing.qwen_vl import qwen_vl_hf_inputs


def greedy(n: int, **extra) -> SamplingParams:
    """Exactly `n` greedy tokens (EOS ignored), as the parity tests compare them; `extra`: more
    fields (logprobs=3, stop=...)."""
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **extra)


@contextmanager
def serve_in_thread(app, *, lifespan: str = "auto", startup_timeout: float = 30) -> Iterator[str]:
    """Yields the base URL while `app` is served; stops the server on exit."""
    import uvicorn  # only the tests that serve need it (the GPU machine lacks it)

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", lifespan=lifespan,
                            timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def engine_idle(stats: dict) -> bool:
    """Nothing running or waiting, and no KV block held."""
    return not (stats["requests_running"] or stats["requests_waiting"] or stats["kv_blocks_used"])


def wait_idle(llm, timeout: float = 10.0) -> dict:
    """The engine's stats once it is idle (blocking)."""
    deadline = time.monotonic() + timeout
    while not engine_idle(stats := llm.stats()):
        assert time.monotonic() < deadline, f"the engine did not become idle: {stats}"
        time.sleep(0.02)
    return stats


async def wait_idle_async(llm, timeout: float = 10.0) -> dict:
    """The engine's stats once it is idle (awaiting)."""
    deadline = time.monotonic() + timeout
    while not engine_idle(stats := llm.stats()):
        assert time.monotonic() < deadline, f"the engine did not become idle: {stats}"
        await asyncio.sleep(0.02)
    return stats


def pace_steps(monkeypatch, llm, seconds: float) -> None:
    """Make each of `llm`'s engine steps take `seconds` longer (for this test), so the tiny
    model, which decodes about 100 tokens/s, streams at the pace of a real one."""
    engine = llm.engine
    step = engine.step

    def paced_step():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(engine, "step", paced_step)


def assert_released(llm) -> None:
    """The engine's bookkeeping is consistent and no KV block or encoder output is referenced."""
    llm.engine.check_integrity()
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["encoder_cache_referenced"] == 0


def assert_top_logprobs(logprobs: list[dict[int, float]], ref, k: int) -> None:
    """Each step's top-k {token: logprob} equals the top k of `ref[step]` (a [steps, vocab]
    tensor of log-probabilities): the same tokens in order, values within 1e-4."""
    for step, entry in enumerate(logprobs):
        top = ref[step].topk(k)
        assert list(entry) == top.indices.tolist(), f"step {step}"
        torch.testing.assert_close(torch.tensor(list(entry.values())), top.values,
                                   atol=1e-4, rtol=0)


def count_calls(module) -> list[int]:
    """A one-element list that counts `module`'s forwards from now on."""
    calls = [0]

    def hook(*_):
        calls[0] += 1

    module.register_forward_hook(hook)
    return calls


def process_chat(llm, messages, mm_processor_kwargs=None):
    """The engine's processed prompt for `messages`, and the decoded media behind it (the
    references need their sampling rates and samples)."""
    p = llm.engine.processor
    parsed = p.render_chat(messages, mm_processor_kwargs=mm_processor_kwargs)
    media = p.load_media_sync(parsed)
    return p.process(parsed, media), media


# ---- media and references for the model-family parity tests ------------------------------------


def random_image(h: int, w: int, seed: int):
    """A PIL image of uniform noise (decisive for tiny random towers)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def random_video(frames: int, h: int, w: int, seed: int):
    """uint8 frames [frames, h, w, 3] of uniform noise."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, (frames, h, w, 3), dtype=np.uint8)


def user(*parts) -> list[dict]:
    """One user message: str parts are text, PIL images images, (waveform, rate) tuples audio,
    dicts content parts as they are, arrays and encoded bytes videos."""
    from PIL import Image

    content = []
    for part in parts:
        if isinstance(part, str):
            content.append({"type": "text", "text": part})
        elif isinstance(part, Image.Image):
            content.append({"type": "image", "image": part})
        elif isinstance(part, tuple):
            content.append({"type": "audio", "audio": part})
        elif isinstance(part, dict):
            content.append(part)
        else:
            content.append({"type": "video", "video": part})
    return [{"role": "user", "content": content}]


def hf_greedy(hf, kwargs: dict, prompt_len: int, n: int):
    """transformers' greedy tokens for `kwargs` (exactly n of them) and each step's
    log-probabilities [n, vocab]."""
    never = hf.config.get_text_config().vocab_size  # an EOS id no argmax produces
    with torch.no_grad():
        out = hf.generate(**kwargs, max_new_tokens=n, do_sample=False, eos_token_id=never,
                          pad_token_id=never, output_scores=True, return_dict_in_generate=True)
    return (out.sequences[0, prompt_len:].tolist(),
            torch.stack(out.scores)[:, 0].float().log_softmax(-1))


def qwen_vl_reference(hf, llm, messages, n: int):
    """transformers' greedy tokens and log-probabilities (hf_greedy) for the prompt the engine
    builds from `messages`, through qwen_vl_hf_inputs."""
    proc, _ = process_chat(llm, messages)
    return hf_greedy(hf, qwen_vl_hf_inputs(hf, proc), len(proc.token_ids), n)


def assert_rope_index_positions(llm, hf, messages, label: str = "") -> None:
    """Our mRoPE positions and delta for `messages` equal transformers' get_rope_index."""
    proc, _ = process_chat(llm, messages)
    kwargs = qwen_vl_hf_inputs(hf, proc)
    ref, delta = hf.model.get_rope_index(
        kwargs["input_ids"], kwargs["mm_token_type_ids"], kwargs.get("image_grid_thw"),
        kwargs.get("video_grid_thw"))
    assert torch.equal(proc.position_info.window(0, len(proc.token_ids)), ref[:, 0]), label
    assert proc.position_info.delta == int(delta), label


def assert_matches_reference(output, tokens: list[int], logprobs, label: str = "",
                             k: int = 3, atol: float = 1e-3) -> None:
    """Greedy tokens identical, and each step's reference top-k tokens among ours with
    log-probabilities within `atol` (`output` generated with logprobs >= k)."""
    assert output.outputs[0].token_ids == tokens, label
    for step, entry in enumerate(output.outputs[0].logprobs):
        top = logprobs[step].topk(k)
        for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            assert abs(entry[t] - v) < atol, (label, step, t)


def run_chunks(model, seqs, block_size: int = 16) -> list:
    """Drive `model` directly (no scheduler) over one flat batch: seqs are (all ids, start,
    end, block ids) per sequence -> logits [end - start, V] each."""
    from models.layers.attention_metadata import build_metadata

    ids, pos = [], []
    for all_ids, start, end, _ in seqs:
        ids += all_ids[start:end]
        pos += range(start, end)
    meta = build_metadata(
        [s for _, s, _, _ in seqs], [e - s for _, s, e, _ in seqs], [b for *_, b in seqs],
        block_size, torch.device("cpu"), windows=model.attention_windows(),
    )
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(ids), torch.tensor(pos), meta))
    out, offset = [], 0
    for _, s, e, _ in seqs:
        out.append(logits[offset : offset + e - s])
        offset += e - s
    return out


def walk(compiler, spec, seed: int, limit: int = 200) -> list[int]:
    """A reply the grammar of `spec` (StructuredOutputs) allows, each token drawn at random
    among the ones `compiler` (engine.grammar.GrammarCompiler) allows (EOS only once nothing
    else is); AssertionError if it has not ended within `limit` tokens."""
    state = compiler.state(spec)
    gen = torch.Generator().manual_seed(seed)
    eos, out = compiler.eos_token_ids[0], []
    for _ in range(limit):
        row = torch.zeros(compiler.mask_words, dtype=torch.int32)
        state.fill(row, out)
        bits = (row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
        allowed = bits.flatten().nonzero().flatten().tolist()
        allowed = [i for i in allowed if i != eos] or allowed
        token = allowed[int(torch.randint(len(allowed), (1,), generator=gen))]
        out.append(token)
        assert state.error is None
        if token == eos or state.accept(token, out):
            assert state.error is None, state.error
            return out
    raise AssertionError(f"the grammar did not end within {limit} tokens")
