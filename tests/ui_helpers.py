"""What the UI handler tests share (tests/test_ui_handlers.py, tests/test_models_ui.py): the decoding panel's
values as the browser sends them, and a chat message run to the end of its answer."""

from __future__ import annotations

from app.serve.ui.chat import ChatUI, ChatView, Session
from app.serve.ui.settings import FIELDS, default_settings


def values(**over) -> list:
    """Decoding-panel widget values in FIELDS order (as the browser sends them: sliders as floats)."""
    s = default_settings() | {"mode": "greedy", "max_new_tokens": 64.0} | over
    return [s[k] for k in FIELDS]


def say(ui: ChatUI, session: Session, text: str, system: str = "", **settings) -> list[ChatView]:
    """Submit a message and run the answer to the end; returns every view the generator yielded."""
    ui.submit(session, text, system, *values(**settings))
    return list(ui.generate(session))
