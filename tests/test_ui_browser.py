"""The app in a real browser: Playwright drives Debian's chromium (never a downloaded browser)
to upload an image, watch the reply stream in, read the placeholder panel, stop a long
generation, and load a model from the picker while its start-up stage shows. Screenshots go to
test-artifacts/."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeout

from api import create_app
from engine import AsyncLLM
from engine.remote import RemoteConfig, connect
from launch.web import build_app
from tests.api_fixtures import running_server
from tests.helpers import pace_steps, wait_idle
from tests.ui_fixtures import (
    ENGINE_OPTIONS,
    VL,
    demo_engines,
    demo_root,
    image_offset,
    running_app,
)
from ui.demo import DEMO_NOTE, ensure_demo_models, ensure_samples

CHROMIUM = Path("/usr/bin/chromium")
# Without the background-networking flags chromium's own connections are refused by a closed
# network; Playwright adds --headless and a fresh, empty user-data directory itself. The fake
# media device stands in for a webcam.
FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream",
]
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
LATE = "demo-loaded-when-chosen"  # the picker lists it; it loads when chosen
THINKING = "demo-minicpm-v-4.6"  # its template opens <think>

pytestmark = [
    pytest.mark.browser,
    # Gradio's queue statistics use pandas options that pandas 3 deprecates; not ours to fix.
    pytest.mark.filterwarnings("ignore::pandas.errors.Pandas4Warning"),
    # Skipped on a developer machine without chromium; in CI (where .ci/run installs it) a
    # missing browser fails the run instead of hiding the UI tests.
    pytest.mark.skipif(
        not CHROMIUM.exists() and os.environ.get("CI") != "true",
        reason="Debian's chromium is not installed (apt-get install chromium chromium-driver)",
    ),
]


class HeldLoad:
    """The picker's loader of LATE (the demo's Qwen2-VL checkpoint again): it holds the start-up
    at its reading of the weights until `release`, so that the page can be seen showing it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.release = threading.Event()
        self.loaded: list[AsyncLLM] = []

    def __call__(self, progress) -> AsyncLLM:
        def held(report) -> None:
            progress(report)
            if report.stage == "reading weights" and report.done == 0:
                self.release.wait(120)

        self.loaded.append(AsyncLLM(self.path, load_progress=held, **ENGINE_OPTIONS))
        return self.loaded[-1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = demo_root(tmp_path_factory)
    with demo_engines(root) as engines:
        # Replies here sample (temperature 0.7) from random weights: without EOS they end only
        # at max tokens or Stop, so each test knows which finish to wait for (with it, a
        # 16-token reply of a byte vocabulary drew EOS now and then).
        for name in (VL, THINKING):
            engines[name].engine.eos_token_ids = frozenset()
        late = HeldLoad(ensure_demo_models(root)[VL])
        app = build_app(engines, notes=dict.fromkeys(engines, DEMO_NOTE),
                        available={LATE: late})
        try:
            with running_app(app) as url:
                yield engines, ensure_samples(root), url, late
        finally:
            late.release.set()
            for llm in late.loaded:
                llm.shutdown()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        expect.set_options(timeout=60_000)  # generous: a busy 2-core CI machine is slow
        yield browser
        browser.close()


def open_app(browser, url: str):
    """A new tab on the app, its settings open."""
    page = browser.new_page(viewport={"width": 1400, "height": 1000}, permissions=["camera"])
    page.set_default_timeout(60_000)
    page.goto(url)
    page.locator("#composer textarea").wait_for()
    page.get_by_text("Generation settings").click()
    return page


@pytest.fixture(scope="module")
def page(served, browser):
    page = open_app(browser, served[2])
    yield page
    page.close()


@pytest.fixture(autouse=True)
def screenshot_on_failure(request, page):
    yield
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        screenshot(page, f"failed-{request.node.name}.png")


def set_max_tokens(page, n: int) -> None:
    field = page.locator("#max-tokens input[type=number]")
    field.fill(str(n))
    field.press("Enter")


def send(page, text: str, files=()) -> None:
    if files:
        page.locator("#composer input[type=file]").set_input_files([str(f) for f in files])
        page.locator("#composer .thumbnail-item").first.wait_for()
    page.locator("#composer textarea").fill(text)
    sent = page.locator("#chatbot [data-testid=user]")
    before = sent.count()
    # Gradio ignores a submit while the previous one is still pending (trigger_mode "once"),
    # which on a loaded machine can outlast the reply's last update: press Enter until the
    # message shows. A press while this submit is pending is ignored the same way.
    for _ in range(30):
        page.locator("#composer textarea").press("Enter")
        try:
            page.wait_for_function(
                f"() => document.querySelectorAll('#chatbot [data-testid=user]').length > {before}",
                timeout=2_000,
            )
            return
        except PlaywrightTimeout:
            continue
    raise AssertionError(f"the message {text!r} was never sent")


def screenshot(page, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=ARTIFACTS / name, full_page=True)


def test_upload_an_image_and_see_its_placeholder(page, served):
    from playwright.sync_api import expect

    engines, samples, _, _ = served
    set_max_tokens(page, 24)
    send(page, "Describe this image.", [samples.image])
    expect(page.locator("#chatbot [data-testid=user] img")).to_have_count(1)
    expect(page.locator("#chatbot [data-testid=bot]").last).not_to_be_empty()
    offset = image_offset(engines[VL].tokenizer)
    expect(page.locator("#placeholders")).to_contain_text(f"image 1 · @{offset} ×54 · 54 embeds")
    expect(page.locator("#items")).to_contain_text("image 1")
    expect(page.locator("#timing")).to_contain_text("finish length")
    expect(page.locator("#cache")).to_contain_text("encoded by this request")
    wait_idle(engines[VL])
    screenshot(page, "ui-browser-image.png")


def test_a_webcam_snapshot_is_attached_to_the_message(page, served):
    from playwright.sync_api import expect

    page.get_by_text("Webcam snapshot").click()
    page.get_by_text("Click to Access Webcam").click()
    # Capture only once chromium's fake camera delivers frames (slow on a loaded machine): a
    # click before that captures nothing. (Not any <video>: the examples' sample video can be
    # ready first.)
    page.wait_for_function(
        "() => { const v = document.querySelector('#webcam video');"
        " return v !== null && v.readyState >= 2 && v.videoWidth > 0; }"
    )
    page.locator("#webcam").get_by_label("capture photo").click()
    expect(page.locator("#composer .thumbnail-item")).to_have_count(1)
    send(page, "What do you see?")
    expect(page.locator("#chatbot [data-testid=user] img")).to_have_count(2)
    expect(page.locator("#placeholders")).to_contain_text("image 2 · @")
    expect(page.locator("#timing")).to_contain_text("finish length")
    wait_idle(served[0][VL])
    page.get_by_text("Webcam snapshot").click()


def test_stop_aborts_a_long_generation(page, served, monkeypatch):
    from playwright.sync_api import expect

    engines, _, _, _ = served
    # The tiny model decodes ~100 tokens/s, faster than a loaded browser renders the stream:
    # pace it like a real model so that Stop lands mid-reply (4000 tokens are minutes away).
    pace_steps(monkeypatch, engines[VL], 0.05)
    set_max_tokens(page, 4000)
    replies = page.locator("#chatbot [data-testid=bot]")
    n = replies.count()
    send(page, "Now tell me a very long story about it.")
    reply = replies.nth(n)
    page.wait_for_function(
        "el => el.innerText.length > 40", arg=reply.element_handle(), polling=50
    )
    seen = len(reply.inner_text())
    page.wait_for_function(
        f"el => el.innerText.length > {seen}", arg=reply.element_handle(), polling=50
    )  # more text arrives: the reply streams
    page.locator("#stop").click()
    expect(page.locator("#timing")).to_contain_text("finish abort")
    stats = wait_idle(engines[VL])
    assert stats["encoder_cache_referenced"] == 0
    # The engine panel refreshes every second: it shows the freed blocks.
    expect(page.locator("#engine")).to_contain_text("0 running · 0 waiting")
    expect(page.locator("#engine")).to_contain_text("KV blocks in use: 0 /")
    assert "output 4000 tok" not in page.locator("#timing").inner_text()
    screenshot(page, "ui-browser-stopped.png")


def test_a_model_chosen_in_the_picker_shows_its_start_up_stage(page, served):
    from playwright.sync_api import expect

    late = served[3]
    page.get_by_role("combobox", name="Model").click()
    page.get_by_role("option", name=re.compile(LATE)).click()
    info = page.locator("#model-info")
    expect(info).to_contain_text(f"Loading {LATE}")
    expect(info).to_contain_text("reading weights [--------------------] 0/")
    screenshot(page, "ui-browser-loading.png")
    late.release.set()
    expect(info).to_contain_text("Accepts")  # loaded: the model's own line
    assert len(late.loaded) == 1


def test_the_app_as_a_front_end_to_a_remote_server(served, browser):
    from playwright.sync_api import expect

    engines, samples, _, _ = served
    with running_server(create_app(engines)) as api:
        remote = connect(RemoteConfig(f"{api}/v1"))
        with running_app(build_app(remote)) as url:
            tab = open_app(browser, url)
            try:
                expect(tab.get_by_text(f"served by {api}/v1")).to_be_visible()
                set_max_tokens(tab, 24)
                send(tab, "Describe this image.", [samples.image])
                offset = image_offset(engines[VL].tokenizer)
                expect(tab.locator("#placeholders")).to_contain_text(
                    f"image 1 · @{offset} ×54 · 54 embeds")
                expect(tab.locator("#placeholders")).to_contain_text("text tokens")
                expect(tab.locator("#timing")).to_contain_text("finish length")
                # The outcome depends on what the earlier tests left in the server's caches.
                expect(tab.locator("#cache")).to_contain_text(re.compile(
                    "encoded by this request|reused from the encoder cache|from the prefix cache"))
                expect(tab.locator("#engine")).to_contain_text("Engine (remote)")
                screenshot(tab, "ui-browser-remote.png")
            except BaseException:
                screenshot(tab, "failed-remote.png")
                raise
            finally:
                tab.close()
    wait_idle(engines[VL])


def test_a_thinking_model_shows_its_thought_folded(served, browser):
    """The demo's MiniCPM-V thinks (its template opens <think>): the reply's reasoning shows as
    a folded "Thinking" message above where the answer goes."""
    from playwright.sync_api import expect

    page = open_app(browser, served[2])
    try:
        page.get_by_role("combobox", name="Model").click()
        page.get_by_role("option", name=THINKING).click()
        expect(page.get_by_role("combobox", name="Model")).to_have_value(THINKING)
        set_max_tokens(page, 16)
        send(page, "Think it over, then answer.")
        expect(page.locator("#timing")).to_contain_text("finish length")
        bot = page.locator("#chatbot [data-testid=bot]").last
        expect(bot).to_contain_text("Thinking")
        screenshot(page, "ui-browser-thinking.png")
    finally:
        page.close()


def test_the_demo_tool_call_shows_folded_under_its_name(served, browser):
    """The demo's Qwen2-VL template renders tools (Hermes calls): with the demo tool required,
    the reply is a get_weather call, shown as a message titled with its name."""
    from playwright.sync_api import expect

    page = open_app(browser, served[2])
    try:
        expect(page.get_by_role("combobox", name="Model")).to_have_value(VL)
        page.get_by_text("Tools", exact=True).click()
        page.locator("#tool-choice").get_by_text("required", exact=True).click()
        # the grammar bounds the call (compact JSON, one call, its one argument a city of at
        # most 40 characters: under 640 of the demo's byte tokens even as escapes)
        set_max_tokens(page, 640)
        send(page, "What is the weather in Paris?")
        expect(page.locator("#timing")).to_contain_text("finish stop")
        bot = page.locator("#chatbot [data-testid=bot]").last
        expect(bot).to_contain_text("Tool call: get_weather")
        screenshot(page, "ui-browser-tool-call.png")
    finally:
        page.close()
