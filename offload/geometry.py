"""Model geometry for memory planning: per-layer weight sizes and KV shape, read from file headers only.

GGUF: metadata and tensor infos (name, shape, quant type) from the header; tensor data is never touched.
gguf.GGUFReader would do, but it builds a numpy view per vocabulary string (11 s for a 151k-token
Qwen file), so offload/gguf_header.py walks the header with gguf's own type tables; tests check both agree.
Safetensors: config.json plus each shard's JSON header (8-byte length + JSON), again no weights.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path

from offload.errors import BadModelFile
from offload.gguf_header import read_header

_LAYER_GGUF = re.compile(r"blk\.(\d+)\.")
_LAYER_HF = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class ModelGeometry:
    """What the planner needs to know about one model; bytes are as stored in the file."""

    name: str
    format: str  # "gguf" | "safetensors"
    arch: str
    quant: str  # "Q4_K_M", "BF16", ...
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int  # K and V head width (GGUF key_length; value_length is assumed equal)
    hidden_dim: int
    vocab_size: int
    n_ctx_train: int
    layer_bytes: tuple[int, ...]  # [n_layers] stored bytes of blk.N.*
    layer_params: tuple[int, ...]  # [n_layers] elements of blk.N.*
    embed_bytes: int  # token embeddings
    embed_params: int
    head_bytes: int  # output norm + output projection (norm only when tied to the embeddings)
    head_params: int
    tied_embeddings: bool

    @property
    def weight_bytes(self) -> int:
        return sum(self.layer_bytes) + self.embed_bytes + self.head_bytes

    @property
    def n_params(self) -> int:
        return sum(self.layer_params) + self.embed_params + self.head_params

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.weight_bytes / max(1, self.n_params)

    def kv_elems_per_token(self) -> int:
        """K and V elements of one token of one row, all layers (spec §9: b = this x bytes per element)."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim

    def with_bits_per_weight(self, bpw: float, quant: str) -> "ModelGeometry":
        """The same model re-quantised to `bpw` bits per weight (for "a smaller quant would fit" hints)."""
        scale = lambda params: int(params * bpw / 8)  # noqa: E731
        return replace(self, quant=quant, layer_bytes=tuple(scale(p) for p in self.layer_params),
                        embed_bytes=scale(self.embed_params), head_bytes=scale(self.head_params))


def _sizes(layer_b, layer_p, embed: tuple[int, int], head: tuple[int, int]) -> dict:
    """The size fields of a ModelGeometry from per-layer (bytes, params) and (bytes, params) of embed / head."""
    return {"layer_bytes": tuple(layer_b), "layer_params": tuple(layer_p), "embed_bytes": embed[0],
            "embed_params": embed[1], "head_bytes": head[0], "head_params": head[1]}


def read_geometry(path: str | Path, *, name: str | None = None) -> ModelGeometry:
    """Geometry of a .gguf file or a safetensors checkpoint folder. Raises BadModelFile."""
    path = Path(path)
    if path.is_dir():
        return read_safetensors(path, name=name)
    if not path.is_file():
        raise BadModelFile(f"model not found: {path}")
    return read_gguf(path, name=name)


# ---------------------------------------------------------------- GGUF


def read_gguf(path: Path, *, name: str | None = None) -> ModelGeometry:
    header = read_header(path, keep=())  # scalars and the tensor table; arrays only as their length
    meta, tensors = header.metadata, header.tensors
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise BadModelFile(f"{path.name}: GGUF metadata general.architecture is missing")

    def need(key: str) -> int:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise BadModelFile(f"{path.name}: GGUF metadata key {arch}.{key} is missing")
        return int(value)

    n_layers = need("block_count")
    layer_b, layer_p = [0] * n_layers, [0] * n_layers
    embed = head = (0, 0)
    vocab = 0
    for t in tensors:
        tname, shape, b, p = t.name, t.shape, t.n_bytes, t.n_elements
        if m := _LAYER_GGUF.match(tname):
            i = int(m.group(1))
            if i >= n_layers:
                raise BadModelFile(f"{path.name}: tensor {tname} is beyond block_count={n_layers}")
            layer_b[i] += b
            layer_p[i] += p
        elif tname == "token_embd.weight":
            embed, vocab = (b, p), int(shape[-1])  # GGUF shapes are [in, out]
        elif tname.startswith("output"):  # output.weight, output_norm.weight
            head = (head[0] + b, head[1] + p)
    if not vocab:
        raise BadModelFile(f"{path.name}: tensor token_embd.weight is missing")
    dim, n_heads = need("embedding_length"), need("attention.head_count")
    n_kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", n_heads))
    key_len = int(meta.get(f"{arch}.attention.key_length", dim // n_heads))
    val_len = int(meta.get(f"{arch}.attention.value_length", key_len))
    ftype = meta.get("general.file_type")
    return ModelGeometry(
        name=name or str(meta.get("general.name") or path.stem),
        format="gguf",
        arch=arch,
        quant=_file_type(ftype),
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=(key_len + val_len) // 2,
        hidden_dim=int(meta.get(f"{arch}.feed_forward_length", 4 * dim)),
        vocab_size=vocab,
        n_ctx_train=int(meta.get(f"{arch}.context_length", 4096)),
        **_sizes(layer_b, layer_p, embed, head),
        tied_embeddings=not any(t.name == "output.weight" for t in tensors),
    )


def _file_type(ftype) -> str:
    from gguf import LlamaFileType

    try:
        return LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_")
    except (TypeError, ValueError):
        return "unknown"


# ---------------------------------------------------------------- safetensors

def _st_header(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 100 << 20:
                raise BadModelFile(f"{path.name}: safetensors header of {n} bytes is implausible")
            return json.loads(fh.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise BadModelFile(f"cannot read the safetensors header of {path}: {e}") from e


def read_safetensors(folder: Path, *, name: str | None = None) -> ModelGeometry:
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise BadModelFile(f"{folder}: config.json is missing (not a Hugging Face checkpoint folder?)")
    c = json.loads(cfg_path.read_text())
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise BadModelFile(f"{folder}: no *.safetensors files")
    n_layers = int(c["num_hidden_layers"])
    layer_b, layer_p = [0] * n_layers, [0] * n_layers
    embed = head = (0, 0)
    dtypes: dict[str, int] = {}
    for shard in shards:
        for tname, info in _st_header(shard).items():
            if tname == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            b, p = end - begin, 1
            for d in info["shape"]:
                p *= d
            dtypes[info["dtype"]] = dtypes.get(info["dtype"], 0) + b
            if m := _LAYER_HF.match(tname):
                i = int(m.group(1))
                if i < n_layers:
                    layer_b[i] += b
                    layer_p[i] += p
            elif tname == "model.embed_tokens.weight":
                embed = (b, p)
            elif tname in ("lm_head.weight", "model.norm.weight"):
                head = (head[0] + b, head[1] + p)
    dim, n_heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    return ModelGeometry(
        name=name or folder.name,
        format="safetensors",
        arch=str(c.get("model_type", "unknown")),
        quant=max(dtypes, key=dtypes.get) if dtypes else "unknown",
        n_layers=n_layers,
        dim=dim,
        n_heads=n_heads,
        n_kv_heads=int(c.get("num_key_value_heads") or n_heads),
        head_dim=int(c.get("head_dim") or dim // n_heads),
        hidden_dim=int(c.get("intermediate_size", 4 * dim)),
        vocab_size=int(c["vocab_size"]),
        n_ctx_train=int(c.get("max_position_embeddings", 4096)),
        **_sizes(layer_b, layer_p, embed, head),
        tied_embeddings=bool(c.get("tie_word_embeddings", False)),
    )
