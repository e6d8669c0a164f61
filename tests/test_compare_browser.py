"""The Compare tab in a real browser (Debian's headless Chromium, Playwright) over the fake engine: a blind comparison
shows no mode name anywhere in the Compare panel until the vote, the vote reveals them and lands in the
Results view; a prompt set runs in the background to the end with its progress bar."""

from __future__ import annotations

import re

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.filterwarnings("ignore:::gradio.queueing")]
from browser_support import serve, sync_api, launch_browser, wait_text  # noqa: E402  (skips without Chromium)
from app.config import MODES  # noqa: E402
from app.compare.store import ResultStore  # noqa: E402
from fake_engine import FakeEngine  # noqa: E402

# The Blind compare panel as the browser has it (markup, attributes, text), minus the mode checkboxes (they list
# every mode by design) and Gradio's inline layout styles.
PANEL_JS = """() => {
  const panel = document.querySelector('#compare-cards').closest('[role="tabpanel"]').cloneNode(true);
  panel.querySelector('#compare-modes')?.remove();
  panel.querySelectorAll('style').forEach(e => e.remove());  // Gradio's layout CSS says "overflow: auto"
  panel.querySelectorAll('[style]').forEach(e => e.removeAttribute('style'));
  return panel.innerHTML + '\\n' + panel.innerText;
}"""


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    data = tmp_path_factory.mktemp("data")
    app, url = serve(FakeEngine(delay=0.02, answer_words=10, n_ctx=4096), data)
    yield url, data
    app.close()


@pytest.fixture(scope="module")
def page(tmp_path_factory, app_url):
    with sync_api.sync_playwright() as p:
        ctx = launch_browser(p, tmp_path_factory.mktemp("chromium-profile"))
        pg = ctx.new_page()
        pg.goto(app_url[0])
        pg.wait_for_selector("#message textarea")
        pg.get_by_role("tab", name="Compare").click()
        pg.wait_for_selector("#compare-prompt textarea")
        yield pg
        ctx.close()


def mode_names(text: str) -> set[str]:
    return {m for m in MODES if re.search(rf"(?<![\w-]){re.escape(m)}(?![\w-])", text)}


def test_blind_comparison_hides_modes_until_the_vote(page, app_url):
    page.fill("#compare-prompt textarea", "Explain speculative decoding briefly.")
    page.get_by_role("checkbox", name="sample", exact=True).check()  # greedy, beam, dsbd are preselected: four answers
    page.click("#compare-run")
    status = wait_text(page, "#compare-status", "^Done")
    assert "4 answers" in status and re.search(r"Seed \d+ for every answer", status)
    cards = page.locator("#compare-cards .dsbd-card")
    assert cards.count() == 4 and [c.inner_text().splitlines()[0] for c in cards.all()] == \
        ["Answer A", "Answer B", "Answer C", "Answer D"]
    before = page.evaluate(PANEL_JS)
    assert "Answer 1 to Explain" in before  # the answers themselves are there
    assert mode_names(before) == set(), mode_names(before)  # ... but nothing names a mode
    assert "tok/s" not in before and "dsbd-card-stats" not in page.inner_html("#compare-cards")

    page.get_by_label("C is better").check()
    page.click("#compare-vote-btn")
    status = wait_text(page, "#compare-status", "^Vote saved")
    after = page.inner_text("#compare-cards")
    assert mode_names(after) == {"greedy", "beam", "dsbd", "sample"} and "tok/s" in after
    assert re.search(r"C = (greedy|beam|dsbd|sample)", after) and "your pick" in after
    page.locator("#compare-plot img, #compare-plot svg, #compare-plot canvas").first.wait_for()

    (rec,) = ResultStore(app_url[1]).list()  # saved beside the chat history, with the vote
    assert rec["vote"]["choice"] == "C" and rec["vote"]["winner"] == rec["answers"][2]["mode"]
    assert {a["mode"] for a in rec["answers"]} == {"greedy", "beam", "dsbd", "sample"}

    page.get_by_role("tab", name="Results & report").click()
    head = wait_text(page, "#compare-results-head", "saved comparisons")
    assert "**" not in head and re.search(r"1\s+saved comparisons, 1\s+voted", head)
    assert " vs " in page.inner_text("#compare-pair-table")
    page.get_by_role("tab", name="Blind compare").click()


def test_prompt_set_runs_in_background_with_progress(page, app_url):
    page.get_by_role("tab", name="Prompt sets").click()
    page.get_by_label("paste", exact=True).check()
    page.fill("#compare-set-paste textarea", "first question\nsecond question")
    page.click("#compare-set-start")
    wait_text(page, "#compare-set-status", "Running 2 prompts")
    wait_text(page, "#compare-set-progress", r"2 / 2 prompts · done")
    assert "blind votes" in wait_text(page, "#compare-set-status", "Finished")
    assert page.eval_on_selector("#compare-set-progress progress", "e => e.value") == 2
    page.get_by_role("tab", name="Blind compare").click()
    page.click("#compare-next")  # the set's answers come back blind for a vote
    status = wait_text(page, "#compare-status", "Which is better")
    assert "first question" in status and mode_names(page.evaluate(PANEL_JS)) == set()
