"""What the chat-with-files tests share (tests/test_chat_files.py, tests/test_browser_files.py): a small file with
a bug, its fix, and a fake engine that answers with the fix."""

from __future__ import annotations

from app.engine.interface import Event
from fake_engine import FakeEngine


CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
FIXED = CALC.replace("a - b", "a + b")


class Answering(FakeEngine):
    """Answers every chat with `answer` (one done event), recording the messages it was sent."""

    answer = "Fixed:\n\n```python\n" + FIXED + "```\n"

    def _run(self, messages, params, cancel, call_no, auto=None):
        yield Event(text=self.answer, tokens=20, live_beams=0, done=True,
                    stats={"mode": params.mode, "new_tokens": 20, "finish_reason": "stop"})
