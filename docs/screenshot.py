"""Regenerate docs/screenshot.png, the README's picture of the app: the offline demo served on a
free 127.0.0.1 port, one image sent through a real chromium (Debian's, driven by Playwright),
and the page captured once the reply and its panels are in.

    python docs/screenshot.py          # from the repository root, with the test extra installed
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import uvicorn
from playwright.sync_api import expect, sync_playwright

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import AsyncLLM  # noqa: E402
from launch.web import build_app  # noqa: E402
from ui.demo import DEMO_NOTE, ensure_demo_models, ensure_samples  # noqa: E402

FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def main() -> None:
    samples = ensure_samples()
    engines = {name: AsyncLLM(path, kv_cache_bytes=64 << 20)
               for name, path in ensure_demo_models().items()}
    app = build_app(engines, notes=dict.fromkeys(engines, DEMO_NOTE))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path="/usr/bin/chromium", args=FLAGS)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(120_000)
            page.goto(f"http://127.0.0.1:{sock.getsockname()[1]}")
            page.locator("#composer input[type=file]").set_input_files([str(samples.image)])
            page.locator("#composer .thumbnail-item").first.wait_for()
            page.locator("#composer textarea").fill("What shapes are in this picture?")
            page.locator("#composer textarea").press("Enter")
            expect(page.locator("#timing")).to_contain_text("finish", timeout=120_000)
            page.screenshot(path=ROOT / "docs" / "screenshot.png")
            browser.close()
    finally:
        server.should_exit = True
        for llm in engines.values():
            llm.shutdown()


if __name__ == "__main__":
    main()
