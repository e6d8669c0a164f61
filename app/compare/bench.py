"""Benchmark harness: decoding modes run interleaved (A B C A B C ...) on one loaded engine, so ratios hold
on a noisy machine. Writes JSON after every run (resumable); app.compare.report plots it (speed vs quality,
acceptance per depth, widths).

A suite is {"prompts": [str, ...]} (quality = mean target log-prob) or {"tasks": [{"prompt", "entry_point",
"tests": [assert lines], "reference"}, ...]} (quality also = pass rate of the hidden tests, see
app.compare.grading).
Mode `auto[:quality=fast|beam|dynamic]` is the engine's auto mode (app/engine/auto.py): it picks per run, having
observed every earlier run of every mode, as it would observe earlier turns of a chat.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import threading
from collections import Counter
from dataclasses import replace
from pathlib import Path

from app.compare.grading import grade
from app.compare.projection import projected_seconds
from app.attachments import task_prompt as prompt_text
from app.config import ConfigError, DecodeParams, load_presets
from app.engine.engine import final_event

ASSETS = Path(__file__).resolve().parents[2] / "assets" / "bench"


def load_suite(name: str) -> list:
    """Items of a suite in assets/bench/<name>.json (or a JSON file path): prompt strings or task dicts."""
    path = Path(name) if name.endswith(".json") else ASSETS / f"{name}.json"
    if not path.is_file():
        known = sorted(p.stem for p in ASSETS.glob("*.json"))
        raise ConfigError(f"unknown bench suite {name!r}: use one of {known} or a .json file path")
    data = json.loads(path.read_text())
    return data["tasks"] if "tasks" in data else data["prompts"]


# ---------------------------------------------------------------- modes


def split_modes(text: str) -> list[str]:
    """'sample,dsbd:min_beams=4,forest=adaptive,beam-sample' -> ['sample', 'dsbd:min_beams=4,forest=adaptive',
    'beam-sample']: a comma-separated piece with '=' and no ':' is one more setting of the mode before it."""
    out: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if "=" in piece and ":" not in piece and out:
            out[-1] += f",{piece}"
        else:
            out.append(piece)
    return out


def parse_mode(spec: str, base: DecodeParams, machine: str = "cpu",
               keep: tuple[str, ...] = ()) -> tuple[str, DecodeParams]:
    """'dsbd' or 'dsbd:beams=2,gamma=4' or 'auto:quality=beam' or 'preset:Balanced[,gamma=2]' (a UI preset with
    the forest caps of `machine`) -> (label, params). `keep`: settings of `base` a preset does not replace (the
    warp the command line gave); settings written in the spec replace them."""
    mode, _, opts = spec.partition(":")
    kw: dict = {"mode": mode}
    if mode == "preset":
        name, _, opts = opts.partition(",")
        presets = load_presets(machine)
        if name not in presets:
            raise ConfigError(f"unknown preset {name!r} in bench mode {spec!r}; choose one of: {', '.join(presets)}")
        kw = {k: tuple(v) if isinstance(v, list) else v for k, v in presets[name]["settings"].items()
              if k not in keep}
    for item in filter(None, opts.split(",")):
        key, _, value = item.partition("=")
        field = {"level": "quality"}.get(key.strip(), key.strip().replace("-", "_"))  # auto:level= (older runs)
        if field not in DecodeParams.__dataclass_fields__:
            raise ConfigError(f"unknown setting {key!r} in bench mode {spec!r}")
        if field == "lookup_sources":
            kw[field] = tuple(value.split("+"))  # lookup_sources=draft+match
        elif isinstance(getattr(base, field), bool):  # bool("false") is True
            if value.strip().lower() not in ("true", "false", "1", "0", "on", "off"):
                raise ConfigError(f"{key} takes true or false, got {value!r} in bench mode {spec!r}")
            kw[field] = value.strip().lower() in ("true", "1", "on")
        else:
            kw[field] = type(getattr(base, field) if getattr(base, field) is not None else 0)(value)
    return spec, replace(base, **kw).validated()


def run_bench(engine, *, modes: list[str], prompts: list, base: DecodeParams, repeats: int = 1,
              out: Path | None = None, progress: bool = True, profile=None, keep: tuple[str, ...] = ()) -> dict:
    """Run every (repeat, prompt, mode) once, modes innermost; returns {config, runs, summary}.

    `prompts`: strings or task dicts (graded: runs get `passed`). Auto runs record the `setting` they ran.
    `profile`: the engine's cost profile (app.engine.timing); a named one adds each run's projected time there.
    `keep`: settings of `base` that presets keep (parse_mode).
    """
    machine = engine.describe().get("machine", "cpu")
    settings = [parse_mode(m, base, machine, keep) for m in modes]
    for _, p in settings:
        engine.check_params(p)
    config = {"modes": modes, "prompts": prompts, "repeats": repeats, "base": base.as_dict(),
              "models": engine.describe(), "settings": {label: p.as_dict() for label, p in settings}}
    from backends.host import machine_facts

    facts = machine_facts(config["models"].get("cost_profile"))
    runs: list[dict] = []
    if out is not None and out.is_file():  # resume a partial run with the same configuration
        old = json.loads(out.read_text())
        if old.get("config") == config:
            runs = old["runs"]
    for r in runs:  # a resumed bench: the engine relearns from the runs already done, as auto would have
        engine.observe(parse_mode(r.get("setting", r["mode"]), base, machine, keep)[1], r["stats"])
    done = {(r["repeat"], r["prompt"], r["mode"]) for r in runs}
    todo = [(r, i, label, p) for r in range(repeats) for i in range(len(prompts)) for label, p in settings
            if (r, i, label) not in done]
    from tqdm import tqdm

    for r, i, label, params in tqdm(todo, desc="bench", disable=not progress):
        seed = (base.seed or 0) + 1000 * r + i
        run: dict = {"repeat": r, "prompt": i, "mode": label}
        with PeakRSS() as rss:
            last = final_event(engine.chat([{"role": "user", "content": prompt_text(prompts[i])}],
                                           replace(params, seed=seed)))
        run |= {"text": last.text, "stats": last.stats, "peak_rss_bytes": rss.peak}
        if "auto" in last.stats:  # what auto picked, in parse_mode syntax
            run["setting"] = last.stats["auto"]["setting"]
        if isinstance(prompts[i], dict):
            run["passed"] = grade(last.text, prompts[i])
        if (projected := projected_seconds(last.stats, profile)) is not None:
            run["projected"] = projected
        runs.append(run)
        if out is not None:
            _write(out, {"config": config, "machine": facts, "runs": runs, **_calibration(engine)})
    result = {"config": config, "machine": facts, "runs": runs, **_calibration(engine),
              "summary": summarize(runs, [m for m, _ in settings])}
    if out is not None:
        _write(out, result)
    return result


class PeakRSS:
    """The highest resident set size of this process while the block runs: on Linux the kernel's own high-water
    mark (reset on entry, read on exit, so no allocation is missed); elsewhere psutil, sampled every 20 ms."""

    def __enter__(self) -> "PeakRSS":
        self._thread = None
        try:
            _CLEAR_REFS.write_text("5")  # resets VmHWM to the current resident size
            self.peak = _high_water_mark()
        except OSError:
            self.peak = None
        if self.peak is None:
            import psutil

            self._proc, self._stop = psutil.Process(), threading.Event()
            self.peak = self._proc.memory_info().rss
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __exit__(self, *exc) -> None:
        if self._thread is None:
            self.peak = max(self.peak, _high_water_mark() or 0)
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


_CLEAR_REFS, _STATUS = Path("/proc/self/clear_refs"), Path("/proc/self/status")


def _high_water_mark() -> int | None:
    """Linux: this process's peak resident bytes since the last reset (VmHWM); None where there is none."""
    try:
        m = re.search(r"^VmHWM:\s+(\d+) kB", _STATUS.read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) << 10 if m else None


def _calibration(engine) -> dict:
    """The pass costs auto was timed with (seconds per pass by tokens scored), once it has run."""
    policy = engine.policy
    if policy is None:
        return {}
    return {"auto_calibration": {"target": dict(policy.target_cost.points),
                                 "draft": dict(policy.draft_cost.points) if policy.draft_cost else None}}


def _write(path: Path, data: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


# Modes every other mode's speed is compared with, when the run has them: the plain modes of each law.
REFERENCES = ("beam-sample", "beam-sample-repl", "sample", "sps")


def summarize(runs: list[dict], modes: list[str]) -> dict:
    """Per mode: medians and spreads, acceptance per depth, widths, memory, quality; ratios from this run."""
    summary = {}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        if mine:
            summary[mode] = _summary(mine) | _forest_summary(mine) | _outcomes(mine)
    for ref in REFERENCES:
        base = next((m for m in summary if m.split(":")[0] == ref), None)
        if base is None:
            continue
        for mode, s in summary.items():
            s[f"speed_vs_{ref}"] = s["tokens_per_s_median"] / summary[base]["tokens_per_s_median"]
            s[f"overall_speed_vs_{ref}"] = s["tokens_per_s_overall"] / summary[base]["tokens_per_s_overall"]
            if "projected_tokens_per_s_overall" in s and "projected_tokens_per_s_overall" in summary[base]:
                s[f"projected_speed_vs_{ref}"] = (s["projected_tokens_per_s_overall"]
                                                  / summary[base]["projected_tokens_per_s_overall"])
            s[f"same_answers_as_{ref}"] = same_answers(runs, mode, base)
        if ref == "beam-sample":
            for mode, s in summary.items():
                s["logprob_vs_beam_sample"] = paired_logprob(runs, mode, base)
    return summary


def same_answers(runs: list[dict], mode: str, ref: str) -> str:
    """"k/n": of the n prompts (and repeats) both modes answered, how many answers are the same text: a speed
    ratio over identical answers compares the decoders alone, not two realisations of one law."""
    text: dict = {}
    for r in runs:
        if r["mode"] in (mode, ref):
            text.setdefault((r["repeat"], r["prompt"]), {})[r["mode"]] = r.get("text")
    pairs = [x for x in text.values() if mode in x and ref in x]
    return f"{sum(x[mode] == x[ref] for x in pairs)}/{len(pairs)}"


def _summary(mine: list[dict]) -> dict:
    """Speed, acceptance per depth, widths, memory and log-prob of one mode's runs."""
    stats = [r["stats"] for r in mine]
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
    out = {
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
        # the whole process (weights, every context so far) while this mode ran: compare, don't add
        "peak_rss_bytes": max((r["peak_rss_bytes"] for r in mine if "peak_rss_bytes" in r), default=None),
        "mean_target_logprob": statistics.mean(lp) if lp else None,
        "mean_target_logprob_stdev": statistics.stdev(lp) if len(lp) > 1 else None,
        "new_tokens": tokens,
    }
    for key in ("query_tokens_per_pass", "distinct_tokens_per_pass",
                "draft_query_tokens_per_pass", "draft_distinct_tokens_per_pass"):
        passes = "draft_passes" if key.startswith("draft_") else "target_passes"
        mine_pp = [(s[key] * s[passes], s[passes]) for s in stats if key in s]
        if mine_pp:  # tokens a pass asked for / was fed (unique paths), over all passes of the mode
            out[key] = sum(t for t, _ in mine_pp) / max(1, sum(n for _, n in mine_pp))
    return out


def _forest_summary(mine: list[dict]) -> dict:
    """What the forests did: draft tokens kept, layers passed and how, lookup nodes per source, how often an
    adaptive forest drafted at all."""
    stats, out = [r["stats"] for r in mine], {}
    tokens = sum(s["new_tokens"] for s in stats)
    drafted = [s["draft_tokens"] for s in stats if "draft_tokens" in s]
    if drafted:  # share of the returned tokens that were accepted draft tokens
        out["draft_token_share"] = sum(drafted) / max(1, tokens)
    layers = [layer for s in stats for layer in s["acceptance_by_depth"].values()]
    if layers:  # verified forest layers: passed by the drafts alone, or by the cache rule (every output a node)
        passed, by_cache = sum(x["passed"] for x in layers), sum(x.get("passed_by_cache", 0) for x in layers)
        out["layers"] = {"verified": sum(x["attempted"] for x in layers),
                         "passed_by_acceptance": passed - by_cache, "passed_by_cache": by_cache,
                         "lookup_nodes": sum(x.get("lookup_nodes", 0) for x in layers),
                         "lookup_hits": sum(x.get("lookup_hits", 0) for x in layers)}
    sizes = Counter()
    for s in stats:
        sizes.update(s.get("forest_sizes") or {})
    if sizes:  # adaptive forests: the share of iterations that drafted at all
        out["drafted_iterations"] = 1 - sizes.get("g0", 0) / sum(sizes.values())
    sources: dict = {}
    for s in stats:  # lookup nodes and hits per source (draft model, matches, recycled predictions)
        for name, v in (s.get("lookup_sources") or {}).items():
            row = sources.setdefault(name, {"nodes": 0, "hits": 0})
            row["nodes"] += v["nodes"]
            row["hits"] += v["hits"]
    if sources:
        out["lookup_sources"] = sources
    return out


def _outcomes(mine: list[dict]) -> dict:
    """Overall speed, the graded pass rate, the projected speed on a cost profile, auto's settings."""
    stats = [r["stats"] for r in mine]
    tokens = sum(s["new_tokens"] for s in stats)
    seconds = sum(s.get("decode_s") or s["new_tokens"] / max(s["tokens_per_s"], 1e-9) for s in stats)
    out = {"tokens_per_s_overall": tokens / max(1e-9, seconds)}
    if all("pass_s" in s for s in stats):  # the decoder's own time: everything outside the model passes
        own = sum(max(0.0, s["decode_s"] - s["pass_s"] - s.get("draft_pass_s", 0.0)) for s in stats)
        out["decoder_share"] = own / max(1e-9, seconds)
        iterations = sum(s.get("iterations", 0) for s in stats)
        if iterations:
            out["decoder_ms_per_iteration"] = 1e3 * own / iterations
    graded = [r["passed"] for r in mine if "passed" in r]
    if graded:
        out["pass_rate"] = sum(graded) / len(graded)
        out["passed"] = sum(graded)
    proj = [(r["stats"]["new_tokens"], r["projected"]["seconds"]) for r in mine if "projected" in r]
    if proj:  # under a named cost profile: the same answers, on the profile's machine
        out["projected_tokens_per_s_median"] = statistics.median(n / max(s, 1e-9) for n, s in proj)
        out["projected_tokens_per_s_overall"] = sum(n for n, _ in proj) / max(1e-9, sum(s for _, s in proj))
        out["projected_decoder_share"] = sum(r["projected"]["decoder_s"] for r in mine) / max(
            1e-9, sum(s for _, s in proj))
    if any("setting" in r for r in mine):  # auto: how often it picked each concrete setting
        out["settings"] = dict(Counter(r["setting"] for r in mine if "setting" in r).most_common())
    return out


def paired_logprob(runs: list[dict], mode: str, ref: str) -> dict | None:
    """Per-prompt difference of mean target log-prob, mode minus ref: mean, standard error, pairs."""
    lp = {}
    for r in runs:
        v = r["stats"].get("mean_target_logprob")
        if v is not None and r["mode"] in (mode, ref):
            lp.setdefault((r["repeat"], r["prompt"]), {})[r["mode"]] = v
    d = [x[mode] - x[ref] for x in lp.values() if mode in x and ref in x]
    if len(d) < 2 or mode == ref:
        return None
    return {"mean": statistics.mean(d), "se": statistics.stdev(d) / len(d) ** 0.5, "pairs": len(d)}
