"""Benchmark harness: decoding modes run interleaved (A B C A B C ...) on one loaded engine, so ratios hold
on a noisy machine. Writes JSON after every run (resumable) and optionally a speed-vs-quality plot."""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import replace
from pathlib import Path

from .config import ConfigError, DecodeParams

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "bench"


def load_suite(name: str) -> list[str]:
    """Prompts of a suite in assets/bench/<name>.json, or of a JSON file path."""
    path = Path(name) if name.endswith(".json") else ASSETS / f"{name}.json"
    if not path.is_file():
        known = sorted(p.stem for p in ASSETS.glob("*.json"))
        raise ConfigError(f"unknown bench suite {name!r}: use one of {known} or a .json file path")
    return json.loads(path.read_text())["prompts"]


def parse_mode(spec: str, base: DecodeParams) -> tuple[str, DecodeParams]:
    """'dsbd' or 'dsbd:beams=2,gamma=4' -> (label, params)."""
    mode, _, opts = spec.partition(":")
    kw: dict = {"mode": mode}
    for item in filter(None, opts.split(",")):
        key, _, value = item.partition("=")
        field = key.strip().replace("-", "_")
        if field not in DecodeParams.__dataclass_fields__:
            raise ConfigError(f"unknown setting {key!r} in bench mode {spec!r}")
        kw[field] = type(getattr(base, field) if getattr(base, field) is not None else 0)(value)
    return spec, replace(base, **kw).validated()


def run_bench(engine, *, modes: list[str], prompts: list[str], base: DecodeParams, repeats: int = 1,
              out: Path | None = None, progress: bool = True) -> dict:
    """Run every (repeat, prompt, mode) once, modes innermost; returns {config, runs, summary}."""
    settings = [parse_mode(m, base) for m in modes]
    for _, p in settings:
        engine.check_params(p)
    config = {"modes": modes, "prompts": prompts, "repeats": repeats, "base": base.as_dict(),
              "models": engine.describe()}
    runs: list[dict] = []
    if out is not None and out.is_file():  # resume a partial run with the same configuration
        old = json.loads(out.read_text())
        if old.get("config") == config:
            runs = old["runs"]
    done = {(r["repeat"], r["prompt"], r["mode"]) for r in runs}
    todo = [(r, i, label, p) for r in range(repeats) for i in range(len(prompts)) for label, p in settings
            if (r, i, label) not in done]
    from tqdm import tqdm

    for r, i, label, params in tqdm(todo, desc="bench", disable=not progress):
        seed = (base.seed or 0) + 1000 * r + i
        last = None
        for last in engine.chat([{"role": "user", "content": prompts[i]}], replace(params, seed=seed)):
            pass
        runs.append({"repeat": r, "prompt": i, "mode": label, "text": last.text, "stats": last.stats})
        if out is not None:
            _write(out, {"config": config, "runs": runs})
    result = {"config": config, "runs": runs, "summary": summarize(runs, [m for m, _ in settings])}
    if out is not None:
        _write(out, result)
    return result


def _write(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def summarize(runs: list[dict], modes: list[str]) -> dict:
    """Per mode: medians and spreads, acceptance per depth, widths, memory, quality; ratios from this run."""
    summary = {}
    for mode in modes:
        stats = [r["stats"] for r in runs if r["mode"] == mode]
        if not stats:
            continue
        tps = [s["tokens_per_s"] for s in stats]
        acc: dict[str, list[int]] = {}
        widths: dict[str, int] = {}
        for s in stats:
            for d, layer in s["acceptance_by_depth"].items():
                a = acc.setdefault(str(d), [0, 0])
                a[0] += layer["accepted"]
                a[1] += layer["tested"]
            for w, c in s["widths_histogram"].items():
                widths[str(w)] = widths.get(str(w), 0) + c
        lp = [s["mean_target_logprob"] for s in stats if s["mean_target_logprob"] is not None]
        tokens = sum(s["new_tokens"] for s in stats)
        summary[mode] = {
            "runs": len(stats),
            "tokens_per_s_median": statistics.median(tps),
            "tokens_per_s_min": min(tps),
            "tokens_per_s_max": max(tps),
            "steps_per_target_pass": statistics.mean(s["steps_per_target_pass"] for s in stats),
            "target_passes_per_token": sum(s["target_passes"] for s in stats) / max(1, tokens),
            "acceptance_by_depth": {d: a[0] / a[1] if a[1] else None for d, a in sorted(acc.items())},
            "widths_histogram": dict(sorted(widths.items())),
            "peak_kv_bytes_target": max(s["peak_kv_bytes_target"] for s in stats),
            "peak_kv_bytes_draft": max(s["peak_kv_bytes_draft"] for s in stats),
            "mean_target_logprob": statistics.mean(lp) if lp else None,
            "mean_target_logprob_stdev": statistics.stdev(lp) if len(lp) > 1 else None,
            "new_tokens": tokens,
        }
    for ref in ("beam-sample", "sps"):
        base = next((m for m in summary if m.split(":")[0] == ref), None)
        if base is None:
            continue
        for mode, s in summary.items():
            s[f"speed_vs_{ref}"] = s["tokens_per_s_median"] / summary[base]["tokens_per_s_median"]
    return summary


def plot(result: dict, path: Path) -> None:
    """Speed vs quality per mode (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, s in result["summary"].items():
        if s["mean_target_logprob"] is None:
            continue
        ax.scatter(s["tokens_per_s_median"], s["mean_target_logprob"], s=40)
        ax.annotate(mode, (s["tokens_per_s_median"], s["mean_target_logprob"]), fontsize=8,
                    xytext=(4, 4), textcoords="offset points")
    ax.set_xlabel("tokens/s (median)")
    ax.set_ylabel("mean target log-prob per token (higher = better)")
    ax.set_title(f"dsbd-chat bench: {result['config']['models'].get('target', '')}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
