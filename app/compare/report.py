"""Quality report: one page per model pair from saved comparisons (app/compare/store.py, stats.py), as PNG and HTML;
and the bench's plots (`plot_bench`), drawn with the same panels.

Speed against three quality figures with error bars (mean target log-prob, pass rate of hidden tests, blind
win rate), acceptance per draft depth and the widths DSBD chose (from app.compare.bench.summarize), the pairwise
vote tallies and the settings the comparisons ran with. Figures use matplotlib's Figure (no pyplot), so
the UI may draw them from any thread.
"""

from __future__ import annotations

import base64
import io
import json
import re
import time
from html import escape
from pathlib import Path

from matplotlib.figure import Figure

from app.compare.stats import bench_runs, by_pair, mode_summary, pair_tallies


def _acceptance_widths(records: list[dict], modes: list[str]) -> dict:
    """bench.summarize of the answers that carry full engine stats; {} when none do."""
    from app.compare.bench import summarize

    runs = bench_runs(records)
    try:
        return summarize(runs, modes) if runs else {}
    except (KeyError, TypeError, ValueError):  # stats from an older format: leave these pictures out
        return {}


def figure(records: list[dict], title: str = "") -> Figure:
    """2 x 3 panels: speed vs log-prob / pass rate / blind win rate (error bars), acceptance, widths, counts."""
    ms = mode_summary(records)
    modes = list(ms)
    bs = _acceptance_widths(records, modes)
    fig = Figure(figsize=(15, 8.4), dpi=100)
    axes = fig.subplots(2, 3)
    colours = {m: f"C{i % 10}" for i, m in enumerate(modes)}

    def speed_panel(ax, key, lo_hi, label):
        shown = 0
        for m, s in ms.items():
            x, y = s["tokens_per_s_median"], s[key]
            if x is None or y is None:
                continue
            xerr = [[max(0.0, x - s["tokens_per_s_q1"])], [max(0.0, s["tokens_per_s_q3"] - x)]]
            yerr = lo_hi(s, y)
            ax.errorbar([x], [y], xerr=xerr, yerr=yerr, fmt="o", color=colours[m], capsize=3, label=m)
            ax.annotate(m, (x, y), fontsize=8, xytext=(5, 5), textcoords="offset points")
            shown += 1
        ax.set_xlabel("tokens/s (median, bars: quartiles)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if not shown:
            ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes, color="gray")

    def ci_half(s, y):
        return None if s["mean_target_logprob_ci"] is None else [[s["mean_target_logprob_ci"]]] * 2

    def wilson_bars(ci_key):
        return lambda s, y: [[max(0.0, y - s[ci_key][0])], [max(0.0, s[ci_key][1] - y)]]

    speed_panel(axes[0][0], "mean_target_logprob", ci_half, "mean target log-prob / token (95% CI)")
    speed_panel(axes[0][1], "pass_rate", wilson_bars("pass_ci"), "pass rate, hidden tests (Wilson 95%)")
    speed_panel(axes[0][2], "win_rate", wilson_bars("win_ci"), "blind win rate (Wilson 95%)")
    for ax in (axes[0][1], axes[0][2]):
        ax.set_ylim(-0.05, 1.05)

    acceptance_panel(axes[1][0], bs, colours)
    widths_panel(axes[1][1], bs, colours)

    ax = axes[1][2]  # how much evidence stands behind each point
    ax.barh(modes, [ms[m]["answers"] for m in modes], color=[colours[m] for m in modes], alpha=0.4, label="answers")
    ax.barh(modes, [ms[m]["votes"] for m in modes], color=[colours[m] for m in modes], label="voted")
    ax.set_xlabel("answers (light) and blind votes (dark)")
    ax.invert_yaxis()
    fig.suptitle(title or "dsbd-chat quality report")
    fig.tight_layout()
    return fig


def grouped_bars(ax, series: dict[str, dict[int, float]], colours: dict | None = None) -> None:
    """One group of bars per x, one bar per series (label -> {x: height}; a missing x is 0), with a legend."""
    xs = sorted({x for heights in series.values() for x in heights})
    bar = 0.8 / max(1, len(series))
    for j, (label, heights) in enumerate(series.items()):
        ax.bar([x + (j - (len(series) - 1) / 2) * bar for x in xs], [heights.get(x, 0) for x in xs], width=bar,
               label=label, color=(colours or {}).get(label))
    ax.set_xticks(xs or [1])
    if series:
        ax.legend(fontsize=8)


def acceptance_panel(ax, summary: dict, colours: dict | None = None) -> None:
    """Acceptance per draft depth, one bar per drafted mode (bench.summarize's acceptance_by_depth)."""
    grouped_bars(ax, {m: {int(d): a or 0 for d, a in s["acceptance_by_depth"].items()}
                      for m, s in summary.items() if s.get("acceptance_by_depth")}, colours)
    ax.set_xlabel("draft depth")
    ax.set_ylabel("acceptance (accepted / tested)")
    ax.set_ylim(0, 1)


def widths_panel(ax, summary: dict, colours: dict | None = None) -> None:
    """The share of layers run at each width W_L, one bar per DSBD mode (bench.summarize's widths_histogram)."""
    grouped_bars(ax, {m: {int(w): c / sum(h.values()) for w, c in h.items()}
                      for m, s in summary.items() if (h := s.get("widths_histogram"))}, colours)
    ax.set_xlabel("layer width W_L chosen")
    ax.set_ylabel("share of layers")


def png_bytes(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


def _f(v, spec: str = ".2f") -> str:
    return "–" if v is None else f"{v:{spec}}"


def _ci(ci) -> str:
    return "" if not ci else f" [{ci[0]:.2f}, {ci[1]:.2f}]"


def mode_table_html(records: list[dict]) -> str:
    """Per mode: answers, median tok/s with quartiles, log-prob ± CI, pass rate and blind win rate with CIs."""
    rows = []
    for m, s in mode_summary(records).items():
        lp = _f(s["mean_target_logprob"], ".3f") + (f" ± {s['mean_target_logprob_ci']:.3f}"
                                                     if s["mean_target_logprob_ci"] is not None else "")
        tps = (f"{s['tokens_per_s_median']:.1f} ({s['tokens_per_s_q1']:.1f}–{s['tokens_per_s_q3']:.1f})"
               if s["tokens_per_s_median"] is not None else "–")
        pr = f"{s['pass_rate']:.2f}{_ci(s['pass_ci'])} ({s['passed']}/{s['graded']})" if s["graded"] else "–"
        wr = f"{s['win_rate']:.2f}{_ci(s['win_ci'])} ({s['won']}/{s['votes']})" if s["votes"] else "–"
        rows.append(f"<tr><td><code>{escape(m)}</code></td><td>{s['answers']}</td><td>{s['errors']}</td>"
                    f"<td>{tps}</td><td>{lp}</td><td>{pr}</td><td>{wr}</td></tr>")
    return ('<table class="dsbd-results"><tr><th>mode</th><th>answers</th><th>errors</th>'
            "<th>tok/s median (quartiles)</th><th>mean log-p ± 95% CI</th><th>pass rate [Wilson 95%]</th>"
            f"<th>blind win rate [Wilson 95%]</th></tr>{''.join(rows)}</table>")


def pair_table_html(records: list[dict]) -> str:
    """Per mode pair: A wins / ties / B wins and A's win share among decisive votes with its interval."""
    rows = []
    for (a, b), t in pair_tallies(records).items():
        wr = f"{t['win_rate']:.2f}{_ci(t['win_ci'])}" if t["win_rate"] is not None else "–"
        rows.append(f"<tr><td><code>{escape(a)}</code> vs <code>{escape(b)}</code></td><td>{t['wins']}</td>"
                    f"<td>{t['ties']} ({t['both_bad']} both bad)</td><td>{t['losses']}</td><td>{wr}</td></tr>")
    if not rows:
        return "<p><i>No blind votes yet.</i></p>"
    return ('<table class="dsbd-results"><tr><th>pair (A vs B)</th><th>A wins</th><th>ties</th><th>B wins</th>'
            f"<th>A's win rate, decisive votes [Wilson 95%]</th></tr>{''.join(rows)}</table>")


def settings_html(records: list[dict]) -> str:
    """The settings each mode ran with (as the engine saw them) and the seed policy."""
    params: dict[str, dict] = {}
    for r in records:
        for a in r["answers"]:
            if a.get("params"):
                params.setdefault(a["mode"], {k: v for k, v in a["params"].items() if k != "seed"})
    seeds = sorted({r.get("seed") for r in records if r.get("seed") is not None})
    seed_txt = f"{len(seeds)} seed(s), {seeds[0]}–{seeds[-1]}" if seeds else "none"
    rows = "".join(f"<tr><td><code>{escape(m)}</code></td><td><code>{escape(json.dumps(p))}</code></td></tr>"
                   for m, p in params.items())
    return (f"<p>Every mode of one comparison ran with the same seed ({seed_txt}).</p>"
            f'<table class="dsbd-results"><tr><th>mode</th><th>decoding settings</th></tr>{rows}</table>')


def pair_html(pair: str, records: list[dict], png: bytes) -> str:
    """One self-contained page (PNG inlined) for one model pair."""
    models = records[0].get("models", {}) if records else {}
    voted = sum(1 for r in records if r.get("vote"))
    img = base64.b64encode(png).decode()
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>dsbd-chat report: {escape(pair)}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1500px;margin:1em auto;padding:0 1em}}
table{{border-collapse:collapse;margin:0.5em 0}}td,th{{border:1px solid #ccc;padding:3px 8px;font-size:0.9em}}
img{{max-width:100%}}</style></head><body>
<h1>Decoding modes on {escape(pair)}</h1>
<p>{len(records)} comparisons, {voted} with a blind vote; models: <code>{escape(json.dumps(models))}</code>;
written {time.strftime('%Y-%m-%d %H:%M')}.</p>
<img alt="speed vs quality, acceptance and widths" src="data:image/png;base64,{img}">
<h2>Per mode</h2>{mode_table_html(records)}
<h2>Blind votes per pair of modes</h2>{pair_table_html(records)}
<h2>Settings</h2>{settings_html(records)}
<p><small>Intervals: Wilson score 95% for proportions, mean ± 1.96 s/&radic;n for log-prob; tok/s bars are
quartiles. Log-prob rewards short, safe answers: read it beside the pass rate and the blind votes.</small></p>
</body></html>"""


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-")[:80] or "models"


def write_report(records: list[dict], out_dir: str | Path, *, stem: str = "report") -> list[Path]:
    """Per model pair: <stem>-<pair>.png and <stem>-<pair>.html in out_dir. Returns the paths (PNG, HTML, ...)."""
    from app.storage import atomic_write

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for pair, recs in by_pair(records).items():
        png = png_bytes(figure(recs, title=f"dsbd-chat: decoding modes on {pair}"))
        base = out_dir / f"{stem}-{_slug(pair)}"
        png_path = base.with_suffix(".png")
        png_path.write_bytes(png)
        html_path = base.with_suffix(".html")
        atomic_write(html_path, pair_html(pair, recs, png))
        html_path.chmod(0o644)  # a page to share: not the private 0600 of a temp file
        written += [png_path, html_path]
    return written


# ---------------------------------------------------------------- bench plots


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The non-dominated (speed, quality) points, fastest first: none is both faster and better."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (-p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front


def _quality(summary: dict) -> tuple[str, str]:
    """Pass rate when every mode was graded (a code suite), else the mean target log-prob."""
    if summary and all(s.get("pass_rate") is not None for s in summary.values()):
        return "pass_rate", "pass rate of the hidden tests"
    return "mean_target_logprob", "mean target log-prob per token (higher = better)"


def plot_bench(result: dict, path: Path) -> list[Path]:
    """A bench result (app.compare.bench.run_bench) as three PNGs: speed vs quality with its Pareto front at
    `path`, acceptance per depth at <stem>-acceptance.png, chosen widths of the DSBD modes at <stem>-widths.png.
    Returns the paths written."""
    path = Path(path)
    summary = result["summary"]
    title = f"dsbd-chat bench: {result['config']['models'].get('target', '')}"
    key, label = _quality(summary)

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    pts = {}
    for mode, s in summary.items():
        if s.get(key) is None:
            continue
        pts[mode] = (s["tokens_per_s_median"], s[key])
        ax.scatter(*pts[mode], s=40)
    for i, mode in enumerate(sorted(pts, key=pts.get)):  # labels alternate above / below along x
        ax.annotate(mode, pts[mode], fontsize=8, xytext=(4, 5 if i % 2 == 0 else -12), textcoords="offset points")
    front = pareto(list(pts.values()))
    if len(front) > 1:
        ax.plot(*zip(*front), "--", color="gray", lw=1, label="Pareto front")
        ax.legend(fontsize=8)
    ax.set_xlabel("tokens/s (median)")
    ax.set_ylabel(label)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    written = [_save(fig, path)]
    for name, panel in (("acceptance", acceptance_panel), ("widths", widths_panel)):
        fig = Figure(figsize=(7, 4.5))
        ax = fig.subplots()
        panel(ax, summary)
        ax.set_title(title)
        written.append(_save(fig, path.with_name(f"{path.stem}-{name}{path.suffix}")))
    return written


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
