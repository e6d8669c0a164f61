"""Projected time of a run under a cost profile (offload.cost.CostProfile): what the answer would take on
the profile's machine, from what the real decoder did on this one.

    projected = decode_s - (seconds inside the target's and the draft's passes)
                + sum over target passes of C_target(distinct tokens fed) + sum over draft passes of C_draft(...)

Everything the decoder did besides the passes (the verifier, drafting in Python, sampling, commits) stays at its
measured time on this machine; the acceptance, the steps per pass and the forest each pass scored are the real
decoder's, exactly (they depend on the two models and the forest, not on the machine). `passes_by_tokens`
counts the passes by the distinct tokens they fed (backends.unique.CountingContext).
"""

from __future__ import annotations

from typing import Mapping


def _passes_cost(passes: Mapping, curve) -> float:
    return sum(curve(int(n)) * int(k) for n, k in passes.items() if int(n) > 0)


def projected_seconds(stats: Mapping, profile) -> dict | None:
    """{"seconds", "pass_s", "decoder_s"} of one answer under `profile`, or None when the profile is the timed
    one or the stats lack the pass counts."""
    if profile is None or profile.target is None or "passes_by_tokens" not in stats:
        return None
    passes = _passes_cost(stats["passes_by_tokens"], profile.target)
    if stats.get("draft_passes_by_tokens"):
        passes += _passes_cost(stats["draft_passes_by_tokens"], profile.draft)
    decoder = max(0.0, stats["decode_s"] - stats.get("pass_s", 0.0) - stats.get("draft_pass_s", 0.0))
    return {"seconds": passes + decoder, "pass_s": passes, "decoder_s": decoder}
