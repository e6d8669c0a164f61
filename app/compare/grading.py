"""Grading code answers (assets/bench/code.json and prompt sets with tests): the answer's code plus the task's
hidden asserts, run in a fresh interpreter."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.S)


def extract_code(text: str) -> str:
    """The first ```python (or bare ```) block; an unclosed last block counts; else the whole answer."""
    m = _BLOCK.search(text)
    if m:
        return m.group(1)
    start = re.search(r"```(?:python|py)?[ \t]*\n", text)  # cut off by max_tokens mid-block
    return text[start.end():] if start else text


def _limits() -> None:  # runs in the child before exec: caps memory and CPU time, no core files
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
    resource.setrlimit(resource.RLIMIT_CPU, (10, 10))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def grade(answer: str, task: dict, *, timeout: float = 5.0) -> bool:
    """Run the answer's code plus the task's hidden asserts in a fresh `python -I`; True when all pass.

    A subprocess with a timeout and rlimits, a minimal environment and a temporary working folder: enough
    for our own short tasks, not a sandbox for untrusted code.
    """
    program = extract_code(answer) + "\n\n" + "\n".join(task["tests"]) + "\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "solution.py"
        path.write_text(program)
        try:
            done = subprocess.run([sys.executable, "-I", str(path)], cwd=tmp, env={"PATH": os.defpath},
                                  stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout,
                                  preexec_fn=_limits if os.name == "posix" else None)
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0
