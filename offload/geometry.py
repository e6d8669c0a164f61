"""Model geometry for memory planning: per-layer weight sizes and KV shape, read from file headers only.

GGUF: metadata and tensor infos (name, shape, quant type) from the header; tensor data is never touched.
gguf.GGUFReader would do, but it builds a numpy view per vocabulary string (11 s for a 151k-token
Qwen file), so offload/gguf_header.py walks the header with gguf's own type tables; tests check both agree.
Safetensors: config.json (offload/config_json.py) plus each shard's JSON header (8-byte length + JSON), again no
weights.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path

from offload.errors import BadModelFile
from offload.gguf_header import read_header
from offload.config_json import read_config

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
    meta, tensors, hp = header.metadata, header.tensors, header.hyperparameters()
    n_layers = hp.n_layers
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
    return ModelGeometry(
        name=name or str(meta.get("general.name") or path.stem),
        format="gguf",
        arch=hp.arch,
        quant=header.quant,
        n_layers=n_layers,
        dim=hp.dim,
        n_heads=hp.n_heads,
        n_kv_heads=hp.n_kv_heads,
        head_dim=(hp.key_length + hp.value_length) // 2,
        # planning needs only an estimate where the file states no width
        hidden_dim=4 * hp.dim if hp.hidden_dim is None else hp.hidden_dim,
        vocab_size=vocab,
        n_ctx_train=hp.context_length,
        **_sizes(layer_b, layer_p, embed, head),
        tied_embeddings=not any(t.name == "output.weight" for t in tensors),
    )


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
    c = read_config(folder)
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise BadModelFile(f"{folder}: no *.safetensors files")
    n_layers = c.n_layers
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
    return ModelGeometry(
        name=name or folder.name,
        format="safetensors",
        arch="unknown" if c.model_type is None else str(c.model_type),
        quant=max(dtypes, key=dtypes.get) if dtypes else "unknown",
        n_layers=n_layers,
        dim=c.dim,
        n_heads=c.n_heads,
        n_kv_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        hidden_dim=4 * c.dim if c.hidden_dim is None else c.hidden_dim,
        vocab_size=c.vocab_size,
        n_ctx_train=c.context_length,
        **_sizes(layer_b, layer_p, embed, head),
        tied_embeddings=c.tied_embeddings,
    )
