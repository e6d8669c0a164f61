"""GGUF -> Transformer: hyperparameters from the header (offload.gguf_header), weights dequantised with gguf-py.

llama.cpp's converter permutes the Q/K rows of llama-arch models into its interleaved RoPE layout;
we undo that so one rotate-half RoPE serves GGUF and safetensors weights alike. qwen2 files use
llama.cpp's NeoX RoPE and are stored unpermuted.
"""

from __future__ import annotations

import pathlib

import numpy as np
import torch

from backends.base import BadModelFile
from backends.pytorch.model import ARCHS, ModelArgs, Transformer, build
from offload.gguf_header import GGUFHeader, read_header

_LAYER_NAMES = {  # GGUF blk.N.* -> Block attribute
    "attn_norm": "attn_norm",
    "attn_q": "wq",
    "attn_k": "wk",
    "attn_v": "wv",
    "attn_output": "wo",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "w_gate",
    "ffn_up": "w_up",
    "ffn_down": "w_down",
}
_TOP_NAMES = {  # GGUF name -> our state-dict name
    "token_embd.weight": "tok_embeddings.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}


def _reader(path: pathlib.Path):
    import gguf

    try:
        return gguf.GGUFReader(path)
    except FileNotFoundError:
        raise BadModelFile(f"GGUF file not found: {path}") from None
    except Exception as e:  # a truncated or foreign file fails deep inside numpy's memmap
        raise BadModelFile(f"cannot read {path} as GGUF: {e}") from e


def model_args(header: GGUFHeader, reader) -> ModelArgs:
    """ModelArgs from the header's hyperparameters (plus the reader's tensors where metadata is optional)."""
    name = header.name  # the file name
    arch = header.arch
    if arch not in ARCHS:
        raise BadModelFile(
            f"{name}: architecture {arch!r} is not supported by the pytorch backend ({', '.join(ARCHS)})"
        )
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise BadModelFile(f"{name}: tensor token_embd.weight is missing")
    hp = header.hyperparameters()
    for key, value in (("feed_forward_length", hp.hidden_dim), ("attention.layer_norm_rms_epsilon", hp.norm_eps)):
        if value is None:
            raise BadModelFile(f"{name}: GGUF metadata key {arch}.{key} is missing")
    head_dim = hp.key_length
    factors = np.ones(head_dim // 2)
    if "rope_freqs.weight" in tensors:  # llama3-style scaling is stored as per-frequency divisors
        factors = factors * _dequant(tensors["rope_freqs.weight"]).reshape(-1)
    if hp.rope_scaling == "linear":
        factors = factors * hp.rope_scaling_factor
    elif hp.rope_scaling not in ("none", ""):
        raise BadModelFile(f"{name}: RoPE scaling {hp.rope_scaling!r} is not supported by the pytorch backend")
    if hp.rope_dim != head_dim:
        raise BadModelFile(f"{name}: partial RoPE ({hp.rope_dim} of {head_dim} dims) is not supported")
    return ModelArgs(
        arch=arch,
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # GGUF shapes are [in, out]
        dim=hp.dim,
        n_layers=hp.n_layers,
        n_heads=hp.n_heads,
        n_kv_heads=hp.n_kv_heads,
        hidden_dim=hp.hidden_dim,
        head_dim=head_dim,
        norm_eps=hp.norm_eps,
        rope_theta=hp.rope_freq_base,
        rope_factors=None if np.all(factors == 1) else tuple(float(f) for f in factors),
        qkv_bias="blk.0.attn_q.bias" in tensors,
        tied_embeddings="output.weight" not in tensors,
        max_seq_len=hp.context_length,
    )


def _dequant(t) -> np.ndarray:
    from gguf.quants import dequantize

    try:
        a = dequantize(t.data, t.tensor_type)
    except NotImplementedError as e:
        raise BadModelFile(f"tensor {t.name}: quantisation {t.tensor_type.name} is not supported ({e})") from e
    return a.reshape(tuple(int(n) for n in reversed(t.shape)))  # numpy order: [out, in]


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp convert's `permute`: interleaved (GPT-J) rows -> rotate-half (NeoX) rows."""
    out = w.shape[0]
    return w.reshape(n_heads, out // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(name: str) -> str:
    """Our state-dict name -> GGUF tensor name."""
    if not name.startswith("layers."):
        return next(g for g, ours in _TOP_NAMES.items() if ours == name)
    _, i, attr, kind = name.split(".")
    return f"blk.{i}.{next(g for g, ours in _LAYER_NAMES.items() if ours == attr)}.{kind}"


def load_gguf(path: pathlib.Path, *, dtype: torch.dtype, device: torch.device) -> tuple[Transformer, dict]:
    """Build the transformer from a GGUF file; returns (model, extra info for ModelInfo.extra)."""
    reader = _reader(path)
    header = read_header(path, keep=())  # the metadata, parsed by the one GGUF reader; the tensors come from `reader`
    args = model_args(header, reader)
    tensors = {t.name: t for t in reader.tensors}

    def load(name: str) -> torch.Tensor:
        gname = _gguf_name(name)
        if gname not in tensors:
            raise BadModelFile(f"{path.name}: tensor {gname} is missing")
        w = _dequant(tensors[gname])
        kind = gname.split(".")[2] if gname.startswith("blk.") else ""
        if args.arch == "llama" and kind in ("attn_q", "attn_k"):
            w = _unpermute(w, args.n_heads if kind == "attn_q" else args.n_kv_heads)
        # F32/F16 tensors come back as views of the read-only memmap: copy before handing them to torch.
        w = np.array(w, dtype=np.float32, copy=not w.flags.writeable or w.dtype != np.float32, order="C")
        return torch.from_numpy(w).to(device=device, dtype=dtype)

    model = build(args, load)
    extra = {
        "format": "gguf",
        "bos_token_id": header.metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": header.metadata.get("tokenizer.ggml.eos_token_id"),
    }
    return model, extra
