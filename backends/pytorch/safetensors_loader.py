"""Hugging Face checkpoint folder -> Transformer: config.json (read by offload.config_json) + *.safetensors (sharded
or not)."""

from __future__ import annotations

import json
import math
import pathlib

import torch

from backends.base import BadModelFile
from backends.pytorch.model import ModelArgs, Transformer, build
from offload.config_json import CheckpointConfig, read_config

_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}  # HF model_type -> our arch
_LAYER_NAMES = {  # Block attribute -> HF name under model.layers.N.
    "attn_norm": "input_layernorm",
    "wq": "self_attn.q_proj",
    "wk": "self_attn.k_proj",
    "wv": "self_attn.v_proj",
    "wo": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "w_gate": "mlp.gate_proj",
    "w_up": "mlp.up_proj",
    "w_down": "mlp.down_proj",
}
_TOP_NAMES = {  # our state-dict name -> HF name
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name(name: str) -> str:
    """Our state-dict name -> HF checkpoint name (also used by tests to write checkpoints)."""
    if not name.startswith("layers."):
        return _TOP_NAMES[name]
    _, i, attr, kind = name.split(".")
    return f"model.layers.{i}.{_LAYER_NAMES[attr]}.{kind}"


def hf_config(args: ModelArgs) -> dict:
    """A config.json for `args` (inverse of model_args, for plain RoPE)."""
    if args.rope_factors is not None:
        raise ValueError("hf_config: scaled RoPE is not expressible here")
    return {
        "architectures": ["Qwen2ForCausalLM" if args.arch == "qwen2" else "LlamaForCausalLM"],
        "model_type": args.arch,
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "attention_bias": args.qkv_bias,
        "tie_word_embeddings": args.tied_embeddings,
        "max_position_embeddings": args.max_seq_len,
    }


def _llama3_factors(inv_freq: torch.Tensor, rs: dict) -> torch.Tensor:
    """Divisors that turn plain inverse frequencies into llama3-scaled ones (HF's _compute_llama3_parameters)."""
    factor, lo, hi = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old = rs.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / lo, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - lo) / (hi - lo)
    medium = (wavelen >= old / hi) & (wavelen <= old / lo)
    scaled = torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    return inv_freq / scaled


def model_args(c: CheckpointConfig) -> ModelArgs:
    """ModelArgs from what the checkpoint's config.json says."""
    path = c.path
    arch = _MODEL_TYPES.get(c.model_type)
    if arch is None:
        raise BadModelFile(f"{path}: model_type {c.model_type!r} is not supported ({', '.join(_MODEL_TYPES)})")
    if c.hidden_dim is None:
        raise BadModelFile(f"{path}: intermediate_size is missing")
    head_dim, theta = c.head_dim, c.rope_theta
    factors = None
    rs = c.rope_scaling
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        inv = 1.0 / theta ** (torch.arange(head_dim // 2, dtype=torch.float64) * 2 / head_dim)
        if kind == "linear":
            factors = tuple([float(rs["factor"])] * (head_dim // 2))
        elif kind == "llama3":
            factors = tuple(_llama3_factors(inv, rs).tolist())
        elif kind != "default":
            raise BadModelFile(f"{path}: RoPE scaling {kind!r} is not supported by the pytorch backend")
    return ModelArgs(
        arch=arch,
        vocab_size=c.vocab_size,
        dim=c.dim,
        n_layers=c.n_layers,
        n_heads=c.n_heads,
        n_kv_heads=c.n_kv_heads,
        hidden_dim=c.hidden_dim,
        head_dim=head_dim,
        norm_eps=c.norm_eps,
        rope_theta=theta,
        rope_factors=factors,
        qkv_bias=arch == "qwen2" or c.attention_bias,
        tied_embeddings=c.tied_embeddings,
        max_seq_len=c.context_length,
    )


def _weight_map(folder: pathlib.Path) -> dict[str, pathlib.Path]:
    """Tensor name -> shard file, from model.safetensors.index.json or the folder's *.safetensors."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = {name: folder / f for name, f in json.loads(index.read_text())["weight_map"].items()}
        for f in sorted(set(files.values())):
            if not f.is_file():
                raise BadModelFile(f"{folder}: shard {f.name} listed in {index.name} is missing")
        return files
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise BadModelFile(f"{folder}: no *.safetensors files")
    files = {}
    for f in shards:
        with safe_open(f, framework="pt") as sf:
            files.update({name: f for name in sf.keys()})
    return files


def load_safetensors(folder: pathlib.Path, *, dtype: torch.dtype, device: torch.device) -> tuple[Transformer, dict]:
    """Build the transformer from a checkpoint folder; returns (model, extra info)."""
    from safetensors import safe_open

    config = read_config(folder)
    args = model_args(config)
    files = _weight_map(folder)
    if not args.tied_embeddings and "lm_head.weight" not in files:
        raise BadModelFile(f"{folder}: tensor lm_head.weight is missing (and tie_word_embeddings is false)")
    handles: dict[pathlib.Path, object] = {}

    def load(name: str) -> torch.Tensor:
        key = hf_name(name)
        if key not in files:
            raise BadModelFile(f"{folder}: tensor {key} is missing")
        f = files[key]
        if f not in handles:
            handles[f] = safe_open(f, framework="pt", device="cpu")
        try:
            t = handles[f].get_tensor(key)
        except Exception as e:  # a weight_map entry pointing at the wrong shard
            raise BadModelFile(f"{f.name}: cannot read tensor {key}: {e}") from e
        return t.to(device=device, dtype=dtype)

    model = build(args, load)
    extra = {"format": "safetensors", "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    return model, extra
