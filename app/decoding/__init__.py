"""Decoders: generators of `Step` events over the backend protocol (backends.base).

Every decoder takes the same keyword arguments and is picked from `DECODERS` by mode name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from .beams import Beam
from .metrics import Metrics


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


__all__ = ["Step", "Metrics", "Beam", "rng_streams", "derive_seed", "decoder"]
