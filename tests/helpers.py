"""Helpers the tests (and the measurement scripts, through scripts/_common.py) share."""

from __future__ import annotations

import socket

# A code task with hidden tests, as assets/bench/code.json holds them.
ADD_TASK = {"prompt": "Write add(a, b).", "entry_point": "add",
            "tests": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (at the time of asking)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
