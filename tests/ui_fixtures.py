"""Helpers for the UI tests: the demo lineup as small engines, the app served on a free
127.0.0.1 port in a thread, and where an image's placeholder starts."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi import FastAPI

from engine import AsyncLLM
from tests.helpers import serve_in_thread
from ui.demo import ensure_demo_models, ensure_samples

VL, AUDIO, OMNI = "demo-qwen2-vl", "demo-qwen2-audio", "demo-qwen2.5-omni"
MLLAMA = "demo-llama3.2-vision"
NO_AUDIO = "no audio demo model: testing.tiny has no build_qwen2_audio_model yet"
# Small KV caches and batches: the tests need a few sequences, not the defaults' memory.
ENGINE_OPTIONS = dict(kv_cache_bytes=16 << 20, max_num_seqs=8)


def demo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One demo directory per test session (checkpoints and samples are built once)."""
    return tmp_path_factory.getbasetemp() / "ui-demo"


@contextmanager
def demo_engines(root: Path) -> Iterator[dict[str, AsyncLLM]]:
    """The demo lineup as engines (shut down on exit), with the sample media generated."""
    ensure_samples(root)
    engines = {name: AsyncLLM(path, **ENGINE_OPTIONS)
               for name, path in ensure_demo_models(root).items()}
    try:
        yield engines
    finally:
        for llm in engines.values():
            llm.shutdown()


def image_offset(tokenizer) -> int:
    """Where the placeholder of an image that opens a new chat starts in its prompt."""
    template = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}],
        tokenize=False, add_generation_prompt=True,
    )
    return len(tokenizer.encode(template[: template.index("<|image_pad|>")]))


def running_app(app: FastAPI):
    """Serve `app` on a free 127.0.0.1 port in a thread (lifespan on: Gradio's queue starts
    with it); yields the base URL and stops the server on exit."""
    return serve_in_thread(app)

