"""What the browser tests share: Debian's headless Chromium through Playwright (never a downloaded browser),
the app served on 127.0.0.1 in this process, and a waiting helper. Importing it skips the importing test
module when Chromium, Gradio or Playwright is missing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import free_port

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip("headless browser tests need Debian's Chromium: apt-get install -y chromium chromium-driver",
                allow_module_level=True)
pytest.importorskip("gradio")
sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright (uses /usr/bin/chromium)")

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]
WAIT_MS = 30_000
SLOW_MS = 300_000  # the slow steps on a busy machine: timing a new pair's passes, a first answer, a download


def serve(engine, data_dir: Path):
    """Launch the app in this process (Gradio's own thread); returns (app, url)."""
    from app.serve.api import HOST
    from app.serve.ui import QUEUE_KWARGS, build_app, launch_kwargs

    app = build_app(engine, data_dir=data_dir)
    port = free_port()
    app.queue(**QUEUE_KWARGS).launch(server_name=HOST, server_port=port, prevent_thread_lock=True, quiet=True,
                                     inbrowser=False, **launch_kwargs(app))
    return app, f"http://{HOST}:{port}/"


LAPTOP = {"width": 1366, "height": 768}  # the screen each view of the Models tab is sized for


def launch_browser(playwright, profile: Path, viewport: dict | None = None):
    """A persistent Chromium context with the project's flags and the tests' default timeout."""
    ctx = playwright.chromium.launch_persistent_context(
        str(profile), executable_path=str(CHROMIUM), args=ARGS, headless=True,
        viewport=viewport or {"width": 1500, "height": 1000})
    ctx.set_default_timeout(WAIT_MS)
    return ctx


def wait_text(page, selector: str, pattern: str, timeout_ms: int = WAIT_MS) -> str:
    """Wait until the element's text matches the regular expression; return the text."""
    page.wait_for_function("([sel, pat]) => new RegExp(pat).test(document.querySelector(sel)?.innerText || '')",
                           arg=[selector, pattern], timeout=timeout_ms)
    return page.inner_text(selector)


def page_height(page) -> int:
    """The page's height in CSS pixels (what a full-page screenshot shows)."""
    return page.evaluate("document.documentElement.scrollHeight")


def pick(page, dropdown: str, label_starts: str) -> None:
    """Open a Gradio dropdown and click the option whose label starts with `label_starts`."""
    page.click(f"{dropdown} input")
    option = page.locator('[data-testid="dropdown-option"]', has_text=label_starts).first
    option.wait_for()
    option.click()
