"""Time a first start the way a new user has it: `dsbd-chat` launched, the page opened, a question typed and
sent with Enter, the streamed answer finished.

    python scripts/first_start.py [--app PATH/TO/dsbd-chat] [--fresh-home] [--json OUT]

--app is the console script of the environment to time (default: the one beside this Python). With
--fresh-home the app runs with an empty temporary HOME, so the one-time llama.cpp probe and every cache
start empty, as on a new machine. The browser is Debian's Chromium (/usr/bin/chromium) through Playwright.
Prints JSON: seconds from launch to the first page served, to the page usable in the browser, and to the
first answer's "Done".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import _common  # noqa: F401  (the repository and tests/ on sys.path)
from helpers import free_port

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


def wait_http(url: str, proc: subprocess.Popen, limit: float) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"the app exited with code {proc.returncode} before serving {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"no page at {url} after {limit:.0f} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--app", default=str(Path(sys.executable).with_name("dsbd-chat")))
    ap.add_argument("--fresh-home", action="store_true", help="run the app with an empty temporary HOME")
    ap.add_argument("--question", default="Say hello in one short sentence.")
    ap.add_argument("--limit", type=float, default=600, help="seconds to wait for each stage")
    ap.add_argument("--json", help="also write the result here")
    a = ap.parse_args()

    from playwright.sync_api import sync_playwright

    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False")
    home = tempfile.mkdtemp(prefix="dsbd-first-") if a.fresh_home else None
    if home:
        env["HOME"] = home
        env.pop("XDG_CACHE_HOME", None)
        env.pop("DSBD_CHAT_CACHE", None)
    t0 = time.monotonic()
    proc = subprocess.Popen([a.app, "--port", str(port), "--no-browser"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    out: dict = {"app": a.app, "fresh_home": a.fresh_home, "question": a.question}
    try:
        wait_http(url, proc, a.limit)
        out["first_page_s"] = round(time.monotonic() - t0, 1)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=ARGS, headless=True)
            page = browser.new_page()
            page.set_default_timeout(a.limit * 1000)
            page.goto(url)
            box = page.locator("#message textarea")
            box.wait_for()
            out["page_ready_s"] = round(time.monotonic() - t0, 1)
            box.click()
            page.keyboard.type(a.question)
            t_send = time.monotonic()
            page.keyboard.press("Enter")
            page.wait_for_function("document.querySelector('#status')?.innerText.startsWith('Done')")
            out["answer_s"] = round(time.monotonic() - t_send, 1)
            out["first_answer_s"] = round(time.monotonic() - t0, 1)
            out["answer"] = page.locator('#chatbot [data-testid="bot"]').last.inner_text()
            out["stats"] = page.inner_text("#stats").splitlines()[:2]
            browser.close()
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
    text = json.dumps(out | {"machine": _common.machine()}, indent=2)
    print(text)
    if a.json:
        Path(a.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
