"""A front end for a remote server runs without torch and transformers (a remote-only install
has neither): in a fresh interpreter where importing them fails, `app.py --backend` builds
the UI over a server's models, a turn streams and its panels render."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from tests.api_fixtures import running_server
from tests.vllm_standin import StandIn

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent('''
    import asyncio, sys
    sys.modules["torch"] = sys.modules["transformers"] = None  # importing them fails

    import app  # the entry point and, through it, every part of launch/
    from engine import SamplingParams
    from launch.engines import load_engines
    from launch.options import parse_args
    from launch.web import build_app
    from ui import panels

    args = parse_args(["--backend", BACKEND])
    engines, notes = load_engines(args)
    built = build_app(engines, notes=notes)
    (llm,) = engines.values()

    async def turn():
        messages = [{"role": "user", "content": [
            {"type": "image", "image": open(IMAGE, "rb").read()},
            {"type": "text", "text": "What is this?"}]}]
        return [o async for o in llm.chat(messages, SamplingParams(max_tokens=4))][-1]

    final = asyncio.run(turn())
    html = panels.result_html(final, llm.stats(), llm.tokenizer)
    assert "image 1" in html and final.outputs[0].finish_reason == "length", html
    try:
        load_engines(parse_args([]))  # the in-process engine needs torch
    except SystemExit as e:
        assert "pip install 'mmserve[engine]'" in str(e), e
    else:
        raise AssertionError("the in-process engine loaded without torch")
    heavy = sorted(m for m in ("torch", "transformers") if sys.modules.get(m) is not None)
    print("loaded:", heavy)
''')


def test_the_remote_front_end_needs_no_torch(tmp_path):
    from tests.media_fixtures import encode_image, gradient

    image = tmp_path / "image.png"
    image.write_bytes(encode_image(gradient(), "PNG"))
    with running_server(StandIn().app()) as url:
        code = f"BACKEND = {url + '/v1'!r}\nIMAGE = {str(image)!r}\n{SCRIPT}"
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
            env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                 "MMSERVE_DEMO_DIR": str(tmp_path / "demo"), "HF_HUB_OFFLINE": "1"},
        )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("loaded: []")
