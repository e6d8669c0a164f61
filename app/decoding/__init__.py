"""Decoders: generators of `Step` events over the backend protocol (backends.base).

`decoder(mode)` picks a mode's decoder; `start` runs it with exactly the keyword arguments it declares: every
decoder takes target, prompt, params, stopper and metrics; a drafted mode's also draft and vocab (the target's
vocabulary size); a forest mode's (DSBD) also costs, policy and nodes (the model-free lookup-node builder).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import numpy as np

from app.config import MODE_FACTS, DecodeParams
from backends.base import Context

from .beams import Beam, Stopper
from .metrics import Metrics

if TYPE_CHECKING:
    from .forest_policy import ForestPolicy
    from .lookups import Builder


@dataclass(frozen=True)
class Step:
    """One decoder event: the tokens final so far (common prefix of every returnable sequence)."""

    final: tuple[int, ...]
    live: int  # beams still being decided between
    done: bool = False
    output: Beam | None = None  # the returned sequence, on the last event
    forest: dict | None = None  # latest draft forest (DSBD), for the UI's forest view


def rng_streams(seed: int | None) -> tuple[np.random.Generator, np.random.Generator]:
    """Spec §11 RNG protocol: one seed spawns independent draft and verify streams."""
    draft, verify = np.random.SeedSequence(seed).spawn(2)
    return np.random.default_rng(draft), np.random.default_rng(verify)


def derive_seed(seed: int | None, index: int) -> int | None:
    """Seed of the index-th of n independent completions."""
    if seed is None:
        return None
    return int(np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0] >> 1)


def _decoders() -> dict[str, Callable[..., Iterator[Step]]]:
    from . import baselines, dsbd

    return {
        "greedy": baselines.greedy,
        "sample": baselines.beam_sampling,
        "beam": baselines.beam_search,
        "beam-sample": baselines.beam_sampling,
        "beam-sample-repl": baselines.beam_sampling,
        "sps": baselines.speculative_sampling,
        "dsbd": dsbd.dsbd,
        "dsbd-mem": dsbd.dsbd,
    }


def decoder(mode: str) -> Callable[..., Iterator[Step]]:
    return _decoders()[mode]


def start(params: DecodeParams, *, target: Context, draft: Context | None, prompt: Sequence[int], stopper: Stopper,
          metrics: Metrics, vocab: int, costs: tuple | None = None, policy: "ForestPolicy | None" = None,
          nodes: "Builder | None" = None) -> Iterator[Step]:
    """The decoder of params.mode (validated) over these contexts, given what it declares (module docstring).
    `costs` / `policy`: an adaptive forest's (target, draft) pass-cost curves, or its policy; `nodes`: the
    model-free lookup-node builder (DSBD only). `draft` None: no draft model (DSBD then drafts nothing)."""
    facts = MODE_FACTS[params.mode]
    extra: dict = {}
    if facts.uses_draft:
        extra |= {"draft": draft, "vocab": vocab}
    if facts.forest:
        extra |= {"costs": costs, "policy": policy, "nodes": nodes}
    elif costs is not None or policy is not None or nodes is not None:
        raise ValueError(f"mode {params.mode!r} sizes no forest: it takes no pass costs, forest policy or nodes")
    return decoder(params.mode)(target=target, prompt=prompt, params=params, stopper=stopper, metrics=metrics,
                                **extra)


__all__ = ["Step", "Metrics", "Beam", "rng_streams", "derive_seed", "decoder", "start"]
