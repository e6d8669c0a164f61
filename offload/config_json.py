"""A Hugging Face checkpoint folder's config.json, the one reader for every user (the planner's geometry, the
PyTorch loader): the transformer's shape under our names, with our defaults where a key is absent."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from offload.errors import BadModelFile


@dataclass(frozen=True)
class CheckpointConfig:
    """What config.json says; None where a key is absent and has no default (each user says what it needs)."""

    path: Path  # the config.json read (for messages)
    model_type: str | None
    n_layers: int  # num_hidden_layers
    dim: int  # hidden_size
    n_heads: int  # num_attention_heads
    n_kv_heads: int  # num_key_value_heads (default: n_heads)
    head_dim: int  # head_dim (default: dim // n_heads)
    hidden_dim: int | None  # intermediate_size
    vocab_size: int
    context_length: int  # max_position_embeddings (default: 4096)
    norm_eps: float  # rms_norm_eps (default: 1e-6)
    rope_theta: float  # default: 10000
    rope_scaling: dict | None
    attention_bias: bool
    tied_embeddings: bool  # tie_word_embeddings
    bos_token_id: int | None
    eos_token_id: int | list | None


def read_config(folder: str | Path) -> CheckpointConfig:
    """The config.json of a checkpoint folder; raises BadModelFile when it is missing, not JSON, or lacks a size."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise BadModelFile(f"{folder}: config.json is missing (not a Hugging Face checkpoint folder?)")
    try:
        c = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BadModelFile(f"cannot read {path}: {e}") from e
    if not isinstance(c, dict):
        raise BadModelFile(f"{path}: not a JSON object")

    def need(key: str) -> int:
        if c.get(key) is None:
            raise BadModelFile(f"{path}: {key} is missing")
        return int(c[key])

    n_layers, dim, n_heads, vocab = (need(k) for k in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                                                          "vocab_size"))
    hidden = c.get("intermediate_size")
    return CheckpointConfig(
        path=path,
        model_type=c.get("model_type"),
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=int(c.get("num_key_value_heads") or n_heads),
        head_dim=int(c.get("head_dim") or dim // n_heads),
        hidden_dim=None if hidden is None else int(hidden),
        vocab_size=vocab,
        context_length=int(c.get("max_position_embeddings", 4096)),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(c.get("rope_theta", 10000.0)),
        rope_scaling=c.get("rope_scaling") or None,
        attention_bias=bool(c.get("attention_bias", False)),
        tied_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_token_id=c.get("bos_token_id"),
        eos_token_id=c.get("eos_token_id"),
    )
