"""Compact renderings of an answer's stats (engine `Event.stats`) and of current memory use."""

from __future__ import annotations

import sys

import psutil

from app.engine.planning import format_bytes


def _num(v, fmt: str, unit: str = "") -> str:
    return "–" if not isinstance(v, (int, float)) else f"{v:{fmt}}{unit}"


def _bytes(n) -> str:
    return format_bytes(n) if isinstance(n, (int, float)) and n > 0 else "–"


def memory_line() -> str:
    """Process RAM, and torch VRAM when torch is already loaded with CUDA (we never import it here)."""
    rss = psutil.Process().memory_info().rss
    line = f"RAM {_bytes(rss)} (this process, {psutil.virtual_memory().percent:.0f}% of system used)"
    torch = sys.modules.get("torch")  # not imported: no torch tensors can live on the GPU
    try:
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            free, total = torch.cuda.mem_get_info()
            line += (f" · VRAM {_bytes(torch.cuda.memory_allocated())} allocated by torch, "
                     f"{_bytes(total - free)} of {_bytes(total)} used on the device")
    except Exception:  # a broken CUDA setup must not break the stats panel
        pass
    return line


def acceptance_line(stats: dict) -> str:
    acc = stats.get("acceptance_by_depth") or {}
    parts = [f"d{d}: {_num(v.get('rate'), '.0%')}" for d, v in acc.items() if isinstance(v, dict)]
    return " · ".join(parts)


def widths_line(stats: dict) -> str:
    hist = stats.get("widths_histogram") or {}
    return " · ".join(f"W={w}×{n}" for w, n in hist.items())


def forest_line(stats: dict) -> str:
    """Adaptive DSBD forests: the (gamma, W_S) each iteration ran, e.g. 'γ2·W_S4 ×9 · no draft ×3'."""
    if stats.get("forest_policy") != "adaptive":
        return ""
    parts = []
    for key, n in (stats.get("forest_sizes") or {}).items():
        g, _, ws = str(key).partition("/")
        label = ("no draft" if g == "g0" else f"{g[1:]} layer(s) of lookup nodes" if ws == "ws0"
                 else f"γ{g[1:]}·W_S{ws[2:]}")
        parts.append(f"{label} ×{n}")
    return " · ".join(parts)


SOURCE_NAMES = {"draft": "draft model", "match": "matches in the text", "recycled": "recycled predictions"}


def sources_line(stats: dict) -> str:
    """Lookup nodes by source and how many an output landed on, e.g. 'matches in the text 12 (7 hit)'."""
    return " · ".join(f"{SOURCE_NAMES.get(name, name)} {v['nodes']} ({v['hits']} hit)"
                      for name, v in (stats.get("lookup_sources") or {}).items())


def pass_tokens_line(stats: dict) -> str:
    """Tokens each pass was asked for vs fed (unique paths score a repeated sequence once), e.g.
    'target 18.5 / 7.2 · draft 9.0 / 4.1'."""
    parts = []
    for label, prefix in (("target", ""), ("draft", "draft_")):
        q, d = stats.get(f"{prefix}query_tokens_per_pass"), stats.get(f"{prefix}distinct_tokens_per_pass")
        if isinstance(q, (int, float)) and isinstance(d, (int, float)):
            parts.append(f"{label} {q:.1f} / {d:.1f}")
    if parts and stats.get("unique_paths") is False:
        parts.append("unique paths off")
    return " · ".join(parts)


def stats_markdown(stats: dict | None, *, memory: bool = True) -> str:
    """A small table of the headline numbers plus one line each for acceptance, widths, KV and memory."""
    if not stats:
        return memory_line() if memory else ""
    head = ("| mode | tokens | tok/s | first token | target passes | steps / pass | mean log-p | finish |\n"
            "|---|---|---|---|---|---|---|---|\n"
            f"| {stats.get('mode', '?')} | {stats.get('new_tokens', '–')} "
            f"| {_num(stats.get('tokens_per_s'), '.1f')} "
            f"| {_num(stats.get('time_to_first_token_s'), '.2f', ' s')} "
            f"| {stats.get('target_passes', '–')} "
            f"| {_num(stats.get('steps_per_target_pass'), '.2f')} "
            f"| {_num(stats.get('mean_target_logprob'), '.3f')} "
            f"| {stats.get('finish_reason') or '–'} |")
    lines = [head, ""]
    if auto := stats.get("auto"):
        timed = f" (timed the passes first: {auto['calibration_s']:.1f} s)" if auto.get("calibration_s") else ""
        lines.append(f"**Auto ({auto.get('quality')}) picked:** {auto.get('setting')} · projected "
                     f"{_num(auto.get('projected_tokens_per_s'), '.1f')} tok/s{timed}  ")
    if acc := acceptance_line(stats):
        wrote, n = stats.get("draft_tokens"), stats.get("new_tokens")
        if isinstance(wrote, int) and n:  # accepted draft tokens in the returned answer
            acc += f" · **from the draft:** {wrote} of {n} tokens ({wrote / n:.0%})"
        lines.append(f"**Acceptance by layer:** {acc}  ")
    if widths := widths_line(stats):
        lines.append(f"**Widths chosen:** {widths}  ")
    if forests := forest_line(stats):
        lines.append(f"**Forest sizes chosen (adaptive):** {forests}  ")
    if sources := sources_line(stats):
        lines.append(f"**Lookup nodes by source:** {sources}  ")
    if tokens := pass_tokens_line(stats):
        lines.append(f"**Query / distinct tokens per pass:** {tokens}  ")
    kv_t, kv_d = stats.get("peak_kv_bytes_target"), stats.get("peak_kv_bytes_draft")
    if kv_t or kv_d:
        lines.append(f"**Peak KV:** target {_bytes(kv_t)} · draft {_bytes(kv_d)}  ")
    if memory:
        lines.append(memory_line())
    return "\n".join(lines)


def stats_footer(stats: dict | None) -> str:
    """One short line for under an answer bubble."""
    if not stats:
        return ""
    mode = str(stats.get("mode", ""))
    if stats.get("auto"):
        mode = f"auto → {stats['auto'].get('setting', mode)}"
    bits = [mode, f"{stats.get('new_tokens', '?')} tokens",
            f"{_num(stats.get('tokens_per_s'), '.1f')} tok/s", f"{stats.get('target_passes', '?')} target passes"]
    if stats.get("finish_reason") == "cancelled":
        bits.append("stopped")
    return " · ".join(b for b in bits if b)
