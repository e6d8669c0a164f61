"""Setup the measurement scripts share: the repository on sys.path, the usual arguments, a preset's pair."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT_DIR = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT_DIR), str(ROOT_DIR / "tests")]


def pair_arguments(*, runs: int, max_tokens: int) -> argparse.ArgumentParser:
    """--preset, --runs, --max-tokens, --threads and --json, with this script's defaults."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen-coder")
    ap.add_argument("--runs", type=int, default=runs)
    ap.add_argument("--max-tokens", type=int, default=max_tokens)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    return ap


def load_pair(preset: str, threads: int):
    """(target, draft) of a preset, loaded with llama.cpp's runtime directly (no engine, no memory plan)."""
    from backends import llamacpp
    from backends.modelfiles.resolution import resolve
    from backends.registry import ModelSpec

    spec = ModelSpec(source=preset, n_threads=threads)
    return tuple(llamacpp.load(resolve(preset, role=role).path, spec) for role in ("target", "draft"))


def machine(cost_profile: str | None = None) -> dict:
    """The machine block every measurement JSON carries (CPU model and flags, cores, GPU, cost profile)."""
    from backends.host import machine_facts

    return machine_facts(cost_profile)


def emit(out: dict, path: str | None, *, show: bool = True) -> None:
    """Print a measurement's JSON (unless `show` is false: a partial result saved as it grows), and write it to
    `path` when one is given."""
    import json

    text = json.dumps(out, indent=1)
    if show:
        print(text)
    if path:
        Path(path).write_text(text + "\n")
