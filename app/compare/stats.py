"""Tallies over saved comparisons: pair win rates, per-mode summaries, with their 95% intervals."""

from __future__ import annotations

import math
import statistics
from itertools import combinations

from app.compare.records import BOTH_BAD, TIE, pair_name

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion k/n (95% by default); (0, 1) when n = 0.
    Chosen over the normal (Wald) interval because it stays inside [0, 1] and behaves at k = 0 or n."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (0.0 if k == 0 else max(0.0, centre - half)), (1.0 if k == n else min(1.0, centre + half))


def mean_ci(xs: list[float], z: float = Z95) -> tuple[float | None, float | None]:
    """Mean and the half-width of its normal-approximation 95% interval (None with fewer than 2 values)."""
    if not xs:
        return None, None
    if len(xs) < 2:
        return statistics.mean(xs), None
    return statistics.mean(xs), z * statistics.stdev(xs) / math.sqrt(len(xs))


def _mode_order(records: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for r in records:
        for a in sorted(r["answers"], key=lambda a: a["mode"]):
            seen.setdefault(a["mode"], None)
    return sorted(seen)


def pair_tallies(records: list[dict]) -> dict[tuple[str, str], dict]:
    """Per unordered mode pair (a, b), a < b: wins of a, ties, losses of a over the voted comparisons holding
    both. 'tie' and 'both-bad' count as ties (both_bad says how many were the latter); when a third mode won
    a comparison, the pair's own order is unknown and that comparison is not counted for it.
    win_rate = wins / (wins + losses) with its Wilson 95% interval (ties left out)."""
    out: dict[tuple[str, str], dict] = {}
    for r in records:
        vote = r.get("vote")
        if not vote:
            continue
        modes = sorted({a["mode"] for a in r["answers"]})
        for a, b in combinations(modes, 2):
            t = out.setdefault((a, b), {"wins": 0, "ties": 0, "losses": 0, "both_bad": 0})
            if vote["choice"] in (TIE, BOTH_BAD):
                t["ties"] += 1
                t["both_bad"] += vote["choice"] == BOTH_BAD
            elif vote["winner"] == a:
                t["wins"] += 1
            elif vote["winner"] == b:
                t["losses"] += 1
    for t in out.values():
        n = t["wins"] + t["losses"]
        t["votes"] = n + t["ties"]
        t["win_rate"] = t["wins"] / n if n else None
        t["win_ci"] = wilson(t["wins"], n)
    return dict(sorted(out.items()))


def mode_summary(records: list[dict]) -> dict[str, dict]:
    """Per mode over the answers without an error: runs, median tok/s (with quartiles), mean log-prob with
    its 95% interval, pass rate (graded answers, Wilson interval), blind win rate = comparisons it won /
    voted comparisons it took part in (Wilson interval; a tie or both-bad is not a win)."""
    out: dict[str, dict] = {}
    for mode in _mode_order(records):
        ans = [(r, a) for r in records for a in r["answers"] if a["mode"] == mode]
        ok = [a for _, a in ans if not a.get("error") and a.get("stats", {}).get("tokens_per_s") is not None]
        tps = sorted(a["stats"]["tokens_per_s"] for a in ok)
        lp = [a["stats"]["mean_target_logprob"] for a in ok if a["stats"].get("mean_target_logprob") is not None]
        graded = [a["passed"] for _, a in ans if a.get("passed") is not None]
        voted = [r for r, _ in ans if r.get("vote")]
        won = sum(r["vote"]["winner"] == mode for r in voted)
        q = statistics.quantiles(tps, n=4, method="inclusive") if len(tps) > 1 else [tps[0]] * 3 if tps else None
        lp_mean, lp_half = mean_ci(lp)
        out[mode] = {
            "answers": len(ans), "errors": len(ans) - len(ok),
            "tokens_per_s_median": statistics.median(tps) if tps else None,
            "tokens_per_s_q1": q[0] if q else None, "tokens_per_s_q3": q[2] if q else None,
            "mean_target_logprob": lp_mean, "mean_target_logprob_ci": lp_half,
            "graded": len(graded), "passed": sum(graded),
            "pass_rate": sum(graded) / len(graded) if graded else None,
            "pass_ci": wilson(sum(graded), len(graded)) if graded else None,
            "votes": len(voted), "won": won,
            "win_rate": won / len(voted) if voted else None,
            "win_ci": wilson(won, len(voted)) if voted else None,
        }
    return out


def bench_runs(records: list[dict]) -> list[dict]:
    """Answers as app.compare.bench runs ({mode, stats, passed}), for bench.summarize (acceptance, widths)."""
    runs = []
    for r in records:
        for a in r["answers"]:
            st = a.get("stats") or {}
            if a.get("error") or "acceptance_by_depth" not in st or "tokens_per_s" not in st:
                continue
            runs.append({"mode": a["mode"], "stats": st} | ({"passed": a["passed"]} if a.get("passed") is not None
                                                             else {}))
    return runs


def by_pair(records: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in records:
        out.setdefault(pair_name(r), []).append(r)
    return out
