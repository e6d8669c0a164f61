"""What the chat-with-files tests share (tests/test_chat_files.py, tests/test_browser_files.py,
tests/test_file_prompts.py): a small file with a bug, its fix, and a fake engine that answers with the fix (in the
chat, and for `dsbd-chat generate`)."""

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


class AnsweringCli(Answering):
    """Answering, with what `dsbd-chat generate` calls too (complete, close), recording the messages each prompt
    was encoded from: the last one is the prompt the CLI sent."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.encoded: list[list[dict]] = []

    def encode(self, messages: list[dict]) -> list[int]:
        self.encoded.append(messages)
        return super().encode(messages)

    def complete(self, prompt, params, *, n: int = 1) -> list[dict]:
        stats = {"mode": params.mode, "new_tokens": 20, "finish_reason": "stop"}
        return [{"text": self.answer, "tokens": 20, "stats": stats} for _ in range(n)]

    def close(self) -> None:
        pass
