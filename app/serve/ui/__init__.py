"""The browser UI: `build_app(engine)` returns the Gradio Blocks (app.serve.api serves it beside the API).

One module per tab (chat, compare, models); settings, stats, forest and downloads are their helpers (saved
chats are app.storage's). Gradio 6 takes CSS and allowed file paths at launch, hence `launch_kwargs` next to `build_app`.
"""

from __future__ import annotations

import os

import gradio as gr

from app.serve.ui import chat, compare, models
from app.compare.store import ResultStore
from app.decoding.lookups import CORPUS_TOKENS
from app.storage import HistoryStore
from backends.base import BackendError
from app.serve.ui.settings import ASSETS, set_machine

QUEUE_KWARGS = {"default_concurrency_limit": 1, "max_size": 64}
CORPUS_CHARS = 8 * CORPUS_TOKENS  # saved chats' text handed to the cross-chat index: more than its token bound


def build_app(engine, *, data_dir: str | os.PathLike | None = None) -> gr.Blocks:
    """The whole app over `engine`; chats are kept in `data_dir` (else $DSBD_CHAT_DATA, else the platform dir)."""
    store = HistoryStore(data_dir)
    remember = getattr(engine, "remember_chats", None)  # (a test's stand-in engine may have none)
    if remember is not None:  # the match source may continue earlier chats' text after a restart too
        try:
            remember([chat.prompt_messages(c) for c in store.recent(CORPUS_CHARS)])
        except BackendError:  # no model loaded, or its process is down: the next one starts with them
            pass
    try:
        set_machine(engine.describe().get("machine", "cpu"))  # the presets' forest caps for this machine
    except Exception:  # noqa: BLE001 - an engine that cannot describe itself still gets a page (CPU caps)
        set_machine("cpu")
    with gr.Blocks(title="dsbd-chat", fill_width=True) as app:
        # One Session per browser tab (the factory runs per page load); closing the tab stops its answer.
        session = gr.State(chat.Session, delete_callback=lambda s: s.cancel.set())
        with gr.Tab("Chat", id="chat"):
            chat_ui, panel, system, outputs = chat.build(engine, store, session)
        with gr.Tab("Compare", id="compare"):
            compare.build(engine, session, system, panel, ResultStore(store.root))  # beside the chats
        with gr.Tab("Models", id="models"):
            models_ui = models.build(engine)
        app.load(chat_ui.on_load, [session], outputs, concurrency_limit=None, show_progress="hidden")
        fn, inputs, outs = models_ui.page_load
        app.load(fn, inputs, outs, concurrency_limit=None, show_progress="hidden")
    app.dsbd_store = store  # for launch_kwargs and tests
    return app


def launch_kwargs(app: gr.Blocks) -> dict:
    """Launch options the app needs: CSS, theme, and its export folder as an allowed download path."""
    css_path = ASSETS / "style.css"
    # System fonts: the default theme would fetch web fonts from Google, and this app stays local.
    theme = gr.themes.Default(font=["ui-sans-serif", "system-ui", "sans-serif"],
                              font_mono=["ui-monospace", "Consolas", "monospace"])
    return {"css": css_path.read_text(encoding="utf-8") if css_path.exists() else None, "theme": theme,
            "js": (ASSETS / "keys.js").read_text(encoding="utf-8"),  # Enter sends, Shift+Enter: new line
            "allowed_paths": [str(app.dsbd_store.exports_dir)]}


__all__ = ["build_app", "launch_kwargs", "QUEUE_KWARGS"]
