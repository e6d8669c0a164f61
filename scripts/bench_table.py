"""Print a bench JSON's summary (dsbd-chat bench --json) as a markdown table, one row per mode.

    python scripts/bench_table.py docs/measurements/qwen-cache-chat.json
"""

from __future__ import annotations

import argparse
import json


def _f(v, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def table(summary: dict) -> str:
    head = ("| mode | tok/s (median) | vs beam-sample | log-prob | vs beam-sample, paired (± SE) | pass | "
            "query / distinct tokens per pass | steps / pass | layers: by acceptance / by cache / verified | "
            "drafted iterations |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for mode, s in summary.items():
        lp = s.get("logprob_vs_beam_sample")
        paired = f"{lp['mean']:+.3f} ± {lp['se']:.3f}" if lp else "–"
        layers = s.get("layers")
        lay = f"{layers['passed_by_acceptance']} / {layers['passed_by_cache']} / {layers['verified']}" if layers else "–"
        passed = f"{s['passed']}/{s['runs']}" if "passed" in s else "–"
        q, d = s.get("query_tokens_per_pass"), s.get("distinct_tokens_per_pass")
        rows.append(f"| `{mode}` | {s['tokens_per_s_median']:.2f} | {_f(s.get('speed_vs_beam-sample'), '.2f')}x | "
                    f"{_f(s.get('mean_target_logprob'), '.3f')} | {paired} | {passed} | {_f(q, '.1f')} / {_f(d, '.1f')} | "
                    f"{s['steps_per_target_pass']:.2f} | {lay} | {_f(s.get('drafted_iterations'), '.0%')} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+")
    for path in ap.parse_args().json:
        data = json.load(open(path))
        print(f"### {path}\n\n{table(data['summary'])}\n")


if __name__ == "__main__":
    main()
