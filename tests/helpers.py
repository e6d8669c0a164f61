"""Helpers the tests (and the measurement scripts, through scripts/_common.py) share."""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import sys
import time

# A code task with hidden tests, as assets/bench/code.json holds them.
ADD_TASK = {"prompt": "Write add(a, b).", "entry_point": "add",
            "tests": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (at the time of asking)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_mid_save(script: str, root, start: int, reports: int, rng: random.Random, done: dict[str, int]) -> int:
    """Run `script` (argv: root, first save number) in a child that prints "<id> <number>" after each completed
    save; after `reports` lines, SIGKILL it somewhere inside the next save (a save is ~10 ms: two fsyncs).
    Every save it reported lands in `done` (id -> last number); returns the last number reported."""
    child = subprocess.Popen([sys.executable, "-c", script, str(root), str(start)], stdout=subprocess.PIPE, text=True)
    try:
        last = start - 1
        for _ in range(reports):
            line = child.stdout.readline()
            assert line, f"child died early (rc={child.poll()})"
            rid, seq = line.split()
            done[rid], last = int(seq), int(seq)
        time.sleep(rng.uniform(0, 0.015))  # land anywhere inside the save in flight
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        for line in child.stdout:  # saves it reported while we slept are complete too
            if line.endswith("\n"):  # a report cut short leaves its save as the in-flight one
                rid, seq = line.split()
                done[rid], last = int(seq), int(seq)
    finally:
        child.kill()
        child.wait(10)
        child.stdout.close()
    return last


HI = [{"role": "user", "content": "Name three colours."}]


def answer(engine, params, messages=HI) -> str:
    """The final text of one chat answer (the last event must say done)."""
    last = None
    for last in engine.chat(messages, params):
        pass
    assert last is not None and last.done
    return last.text
