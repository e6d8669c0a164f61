"""What the decoders derive from their inputs alike: a request's warp (spec §2.1) and the draft model's logits in
the target's vocabulary. Baselines and DSBD both read them here, so their laws stay directly comparable."""

from __future__ import annotations

import numpy as np

from app.config import DecodeParams
from backends.base import host_rows

from .sampling import Warp


def warp_of(params: DecodeParams) -> Warp:
    return Warp(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)


def pad_vocab(logits: np.ndarray, vocab: int) -> np.ndarray:
    """Draft logits in the target's vocabulary: ids the draft lacks get -inf."""
    n = logits.shape[-1]
    if n == vocab:
        return logits
    logits = host_rows(logits)  # rows read in place, or on a device, are copied to the host here
    if n > vocab:
        return logits[..., :vocab]
    pad = np.full(logits.shape[:-1] + (vocab - n,), -np.inf, dtype=logits.dtype)
    return np.concatenate([logits, pad], axis=-1)
