"""Files in a real browser (Debian's Chromium through Playwright): attach a file to a message, see its chip and
the context budget, ask for an edit, see the answer's diff against the file and download the patched file."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.filterwarnings("ignore:::gradio.queueing")]
from browser_support import launch_browser, serve, sync_api, wait_text  # noqa: E402  (skips without Chromium)
from chat_file_helpers import CALC, FIXED, Answering  # noqa: E402


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    engine = Answering(n_ctx=4096, delay=0.0)
    app, url = serve(engine, tmp_path_factory.mktemp("data"))
    with sync_api.sync_playwright() as p:
        ctx = launch_browser(p, tmp_path_factory.mktemp("chromium-profile"))
        page = ctx.new_page()
        page.goto(url)
        page.wait_for_selector("#message textarea")
        yield page, engine
        ctx.close()
    app.close()


def test_attach_ask_for_an_edit_see_the_diff_download_the_patch(page, tmp_path):
    page, engine = page
    src = tmp_path / "calc.py"
    src.write_text(CALC)
    page.locator('#message input[type="file"]').set_input_files(str(src))  # what the 📎 button opens
    chip = wait_text(page, "#attach-info", r"calc\.py .* tokens")
    assert "fits" in chip and "Context: files" in chip
    page.fill("#message textarea", "Fix the bug in add.")
    page.click("#send")
    wait_text(page, "#status", "^Done")
    wait_text(page, "#chatbot", "Changes to calc.py")  # the final bubble renders after the status line
    bot = page.locator('#chatbot [data-testid="bot"]').last.inner_text()
    assert "Changes to calc.py" in bot and "return a + b" in bot
    user = page.locator('#chatbot [data-testid="user"]').last.inner_text()
    assert "calc.py" in user and "whole" in user
    sent = engine.calls[-1][0][-1]["content"]
    assert sent.startswith("File calc.py (") and "return a - b" in sent and sent.endswith("Fix the bug in add.")
    link = page.locator('#patched-files a[download], #patched-files [data-testid="download-link"]').first
    link.wait_for()
    with page.expect_download() as dl:
        link.click()
    got = Path(dl.value.path()).read_text()
    assert got == FIXED
    page.screenshot(path=str(tmp_path / "attach-diff.png"), full_page=True)
