"""Compare tab: one prompt, several decoding modes run one after another, shown side by side.

Each mode reuses the decoding panel's settings with only the mode swapped, so the comparison varies
one thing. A mode that cannot run (e.g. sps without a draft model) gets an error card, not a crash.
"""

from __future__ import annotations

import logging
import threading
import time
from html import escape
from typing import Iterator

import gradio as gr
from matplotlib.figure import Figure

from backends.base import BackendError

from ..config import MODES, ConfigError
from .chat import ENGINE_QUEUE, Session
from .settings import params_from, settings_from_values

log = logging.getLogger(__name__)
DEFAULT_MODES = ["greedy", "beam", "dsbd"]


def run_one(engine, messages: list[dict], settings: dict, mode: str, cancel: threading.Event) -> dict:
    """Run `mode` to the end; {mode, text, stats, error}."""
    stream = None
    try:
        stream = iter(engine.chat(messages, params_from(settings | {"mode": mode}), cancel=cancel))
        last = None
        for last in stream:
            if last.error:
                raise BackendError(last.error)
        if last is None:
            return {"mode": mode, "text": "", "stats": {}, "error": "the engine returned nothing"}
        return {"mode": mode, "text": last.text, "stats": last.stats or {}, "error": None}
    except (ConfigError, ValueError, BackendError) as e:
        return {"mode": mode, "text": "", "stats": {}, "error": str(e)}
    except Exception as e:  # one broken mode must not end the comparison
        log.exception("compare: %s failed", mode)
        return {"mode": mode, "text": "", "stats": {}, "error": f"internal error: {type(e).__name__}: {e}"}
    finally:
        if stream is not None and hasattr(stream, "close"):
            stream.close()


def _fmt(v, spec: str) -> str:
    return f"{v:{spec}}" if isinstance(v, (int, float)) else "–"


def cards_html(results: list[dict], pending: list[str] = ()) -> str:
    """Side-by-side cards: output text and its headline numbers; placeholders for modes still to run."""
    cards = []
    for r in results:
        st = r["stats"]
        if r["error"]:
            body = f'<div class="dsbd-card-error">⚠️ {escape(r["error"])}</div>'
        else:
            body = f'<div class="dsbd-card-text">{escape(r["text"]) or "<i>(empty)</i>"}</div>'
        nums = (f'<div class="dsbd-card-stats">{_fmt(st.get("tokens_per_s"), ".1f")} tok/s · '
                f'{st.get("target_passes", "–")} target passes · '
                f'mean log-p {_fmt(st.get("mean_target_logprob"), ".3f")}</div>')
        cards.append(f'<div class="dsbd-card"><div class="dsbd-card-mode">{escape(r["mode"])}</div>{nums}{body}</div>')
    for m in pending:
        cards.append(f'<div class="dsbd-card dsbd-card-pending"><div class="dsbd-card-mode">{escape(m)}</div>'
                     '<div class="dsbd-card-stats">waiting…</div></div>')
    return f'<div class="dsbd-cards">{"".join(cards)}</div>'


def scatter(results: list[dict]) -> Figure | None:
    """Speed (tokens/s) against quality (mean target log-prob per token), one labelled point per mode."""
    pts = [(r["mode"], r["stats"].get("tokens_per_s"), r["stats"].get("mean_target_logprob"))
           for r in results if not r["error"]]
    pts = [(m, x, y) for m, x, y in pts if isinstance(x, (int, float)) and isinstance(y, (int, float))]
    if not pts:
        return None
    fig = Figure(figsize=(5.2, 3.4), dpi=100)  # no pyplot: thread-safe, no global figure registry
    ax = fig.add_subplot()
    for m, x, y in pts:
        ax.scatter([x], [y], s=46)
        ax.annotate(m, (x, y), textcoords="offset points", xytext=(6, 4), fontsize=9)
    ax.set_xlabel("speed: tokens / s")
    ax.set_ylabel("quality: mean target log-prob")
    ax.margins(x=0.2, y=0.2)  # room for the labels
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


class CompareUI:
    """Handler of the Compare tab."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def run(self, session: Session, prompt: str, modes: list[str], system: str, *values,
            progress=gr.Progress()) -> Iterator[tuple]:  # noqa: B008 (how Gradio injects its progress bar)
        """Yield (cards html, scatter figure, status) after each mode."""
        prompt, modes = (prompt or "").strip(), [m for m in MODES if m in (modes or [])]
        if not prompt or not modes:
            yield gr.skip(), gr.skip(), "Enter a prompt and pick at least one mode."
            return
        settings = settings_from_values(*values)
        messages = ([{"role": "system", "content": system}] if (system or "").strip() else []) + \
            [{"role": "user", "content": prompt}]
        session.cancel = cancel = threading.Event()  # the Stop button of this tab stops the comparison too
        results: list[dict] = []
        t0 = time.perf_counter()
        for i, mode in enumerate(modes):
            if cancel.is_set():
                break
            progress((i, len(modes)), desc=f"{mode} ({i + 1}/{len(modes)})")
            yield cards_html(results, modes[i:]), gr.skip(), f"Running {mode} ({i + 1}/{len(modes)})…"
            results.append(run_one(self.engine, messages, settings, mode, cancel))
        progress((len(results), len(modes)), desc="done")
        done = "Stopped" if cancel.is_set() else "Done"
        yield (cards_html(results, modes[len(results):] if cancel.is_set() else []), scatter(results),
               f"{done}: {len(results)} mode(s) in {time.perf_counter() - t0:.1f} s.")


def build(engine, session: gr.State, system: gr.Textbox, panel) -> CompareUI:
    """Create the Compare tab's widgets; `panel` is the chat tab's decoding panel (shared settings)."""
    ui = CompareUI(engine)
    gr.Markdown("One prompt, several modes, one after another. The other settings come from the "
                "decoding panel on the Chat tab.")
    with gr.Row():
        prompt = gr.Textbox(label="Prompt", lines=3, scale=4, elem_id="compare-prompt")
        with gr.Column(scale=2):
            modes = gr.CheckboxGroup(list(MODES), value=DEFAULT_MODES, label="Modes", elem_id="compare-modes")
            with gr.Row():
                run_btn = gr.Button("Compare", variant="primary", elem_id="compare-run")
                stop_btn = gr.Button("Stop", variant="stop", elem_id="compare-stop")
    status = gr.Markdown("", elem_id="compare-status")
    cards = gr.HTML(cards_html([]), elem_id="compare-cards")
    plot = gr.Plot(label="Speed vs quality", elem_id="compare-plot")
    inputs = [session, prompt, modes, system, *panel.components]
    run_btn.click(ui.run, inputs, [cards, plot, status], concurrency_id=ENGINE_QUEUE, concurrency_limit=1,
                  show_progress_on=[cards])
    stop_btn.click(lambda s: s.cancel.set() or "Stopping…", [session], [status], concurrency_limit=None,
                   show_progress="hidden")
    return ui
