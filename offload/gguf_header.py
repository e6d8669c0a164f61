"""GGUF headers read fast: metadata, tensor infos and where the data starts, never the tensor data.

Public API (plain data, no printing):

- `read_header(path, *, keep=KEEP_TOKENS) -> GGUFHeader`: the header of one .gguf file. Arrays named in `keep`
  are read in full (the tokenizer's token texts and types by default); every other array becomes an
  `ArrayPreview` (element type, length, first items), so a 150k-entry merges list costs a skip, not a decode.
- `parse_header(buf, *, name, file_size=None, keep=...) -> GGUFHeader`: the same over bytes already in memory
  (a header prefix fetched with an HTTP Range request); raises `HeaderTruncated` (with `need`, a byte count to
  try next) when `buf` ends inside the header.
- `GGUFHeader`: `metadata` (key -> value), `types` (key -> GGUF value type name), `tensors` (`TensorInfo`),
  `data_offset`, `file_size`, and derived facts: `arch`, `n_params`, `quant`, `expected_size`,
  `missing_bytes`, `split` ((index, count) of a split file, or None), `context_length`, `n_layers`, and
  `hyperparameters()` (`Hyperparameters`: the transformer's shape, the one reader of `<arch>.*` keys).
- `shard_of(file_name) -> (stem, i, n) | None`: the parts of a split GGUF's name (`m-00002-of-00003.gguf`).
- `metadata_card(header, *, max_items=8, max_chars=400) -> dict`: every key with a JSON-friendly value, long
  strings and arrays truncated (what a metadata card shows).

gguf.GGUFReader would read the same facts, but it builds a numpy view per vocabulary string (seconds for a
150k-token vocabulary); this walks the header with gguf's own type tables instead (tests hold the two equal).
Errors are `offload.errors.BadModelFile` (a file that is not GGUF, or whose header is cut short).
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import threading
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from offload.errors import BadModelFile

KEEP_TOKENS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT: tensor data starts at a multiple of general.alignment

# GGUF value types (gguf.GGUFValueType): struct formats of the fixed-size ones, numpy dtypes for arrays of them.
_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
          12: "<f8"}
_STRING, _ARRAY = 8, 9
_TYPE_NAMES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
               8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}


_SHARD = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$", re.IGNORECASE)


def shard_of(file_name: str) -> tuple[str, int, int] | None:
    """(stem, 1-based shard number, shard count) of a split GGUF's name ("m-00002-of-00003.gguf"), else None."""
    m = _SHARD.match(file_name)
    return (m.group("stem"), int(m.group("i")), int(m.group("n"))) if m else None


class HeaderTruncated(BadModelFile):
    """The bytes end inside the GGUF header; `need` is a byte count that would get further."""

    def __init__(self, message: str, need: int) -> None:
        super().__init__(message)
        self.need = need


@dataclass(frozen=True)
class ArrayPreview:
    """An array that was not kept in full: its element type, its length and its first items."""

    type: str
    count: int
    head: tuple


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # as stored (GGUF order: innermost first)
    ggml_type: int
    offset: int  # from the start of the tensor data

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def n_bytes(self) -> int:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        try:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(self.ggml_type)]
        except (ValueError, KeyError):
            raise BadModelFile(f"tensor {self.name} has unknown ggml type {self.ggml_type}; update gguf") from None
        return self.n_elements * size // block

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        try:
            return GGMLQuantizationType(self.ggml_type).name
        except ValueError:
            return f"type {self.ggml_type}"


@dataclass(frozen=True)
class Hyperparameters:
    """A transformer's shape as a GGUF header's `<arch>.*` keys state it, with the format's defaults filled in;
    None where a key has no default (each user says what it needs)."""

    arch: str
    n_layers: int  # block_count
    dim: int  # embedding_length
    n_heads: int  # attention.head_count
    n_kv_heads: int  # attention.head_count_kv (default: n_heads)
    key_length: int  # attention.key_length (default: dim // n_heads)
    value_length: int  # attention.value_length (default: key_length)
    hidden_dim: int | None  # feed_forward_length
    context_length: int  # context_length (default: 4096)
    norm_eps: float | None  # attention.layer_norm_rms_epsilon
    rope_freq_base: float  # rope.freq_base (default: 10000)
    rope_scaling: str  # rope.scaling.type (default: "none")
    rope_scaling_factor: float  # rope.scaling.factor (default: 1)
    rope_dim: int  # rope.dimension_count (default: key_length)


@dataclass(frozen=True)
class GGUFHeader:
    name: str  # the file name (for messages)
    version: int
    metadata: dict = field(repr=False)
    types: dict = field(repr=False)  # key -> "uint32" | "string" | "array[string]" | ...
    tensors: tuple[TensorInfo, ...] = field(repr=False)
    data_offset: int = 0
    file_size: int | None = None  # None when parsed from a prefix of unknown length

    @property
    def arch(self) -> str | None:
        a = self.metadata.get("general.architecture")
        return a if isinstance(a, str) else None

    def arch_key(self, key: str, default=None):
        """`<arch>.<key>` (e.g. context_length), or `default`."""
        return self.metadata.get(f"{self.arch}.{key}", default) if self.arch else default

    @property
    def context_length(self) -> int | None:
        v = self.arch_key("context_length")
        return int(v) if isinstance(v, (int, np.integer)) else None

    @property
    def n_layers(self) -> int | None:
        """`<arch>.block_count`, None when absent (a vision projector, a damaged file)."""
        v = self.arch_key("block_count")
        return int(v) if isinstance(v, (int, np.integer)) else None

    def hyperparameters(self) -> "Hyperparameters":
        """The transformer's shape from the `<arch>.*` keys; raises BadModelFile when a key it needs is missing."""
        arch = self.arch
        if arch is None:
            raise BadModelFile(f"{self.name}: GGUF metadata general.architecture is missing")

        def get(key: str, default=None):
            return self.metadata.get(f"{arch}.{key}", default)

        def need(key: str) -> int:
            value = get(key)
            if value is None:
                raise BadModelFile(f"{self.name}: GGUF metadata key {arch}.{key} is missing")
            return int(value)

        n_layers, dim, n_heads = need("block_count"), need("embedding_length"), need("attention.head_count")
        key_length = int(get("attention.key_length", dim // n_heads))
        hidden, eps = get("feed_forward_length"), get("attention.layer_norm_rms_epsilon")
        return Hyperparameters(
            arch=arch, n_layers=n_layers, dim=dim, n_heads=n_heads,
            n_kv_heads=int(get("attention.head_count_kv", n_heads)),
            key_length=key_length,
            value_length=int(get("attention.value_length", key_length)),
            hidden_dim=None if hidden is None else int(hidden),
            context_length=int(get("context_length", 4096)),
            norm_eps=None if eps is None else float(eps),
            rope_freq_base=float(get("rope.freq_base", 10000.0)),
            rope_scaling=get("rope.scaling.type", "none"),
            rope_scaling_factor=float(get("rope.scaling.factor", 1.0)),
            rope_dim=int(get("rope.dimension_count", key_length)),
        )

    @property
    def n_params(self) -> int:
        """Elements of every tensor in this file (one shard of a split model counts its own tensors)."""
        return sum(t.n_elements for t in self.tensors)

    @property
    def quant(self) -> str:
        """general.file_type's name ("Q4_K_M"), else the tensor type holding the most elements."""
        from gguf import LlamaFileType

        try:
            return LlamaFileType(int(self.metadata["general.file_type"])).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except (KeyError, TypeError, ValueError):
            pass
        weights: dict[str, int] = {}
        for t in self.tensors:
            if len(t.shape) >= 2:
                weights[t.type_name] = weights.get(t.type_name, 0) + t.n_elements
        return max(weights, key=weights.get) if weights else "unknown"

    @property
    def expected_size(self) -> int:
        """Bytes the file must have to hold every tensor its header lists."""
        end = max((t.offset + t.n_bytes for t in self.tensors), default=0)
        return self.data_offset + end

    @property
    def missing_bytes(self) -> int:
        """How many bytes of tensor data are missing at the end of the file (0: complete)."""
        return 0 if self.file_size is None else max(0, self.expected_size - self.file_size)

    @property
    def split(self) -> tuple[int, int] | None:
        """(0-based index, count) of a split GGUF (split.no / split.count), None for a single file."""
        count = self.metadata.get("split.count")
        if not isinstance(count, (int, np.integer)) or count <= 1:
            return None
        return int(self.metadata.get("split.no", 0)), int(count)


class _Cursor:
    """Little-endian reads over a buffer (a memory map or bytes)."""

    def __init__(self, buf, name: str) -> None:
        self.buf, self.pos, self.name, self.n = buf, 0, name, len(buf)

    def _short(self, need: int):
        return HeaderTruncated(f"{self.name}: GGUF header is truncated (the file ends inside its header)",
                               need=max(need, 2 * self.n))

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > self.n:
            raise self._short(self.pos + size)
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def raw(self, n: int) -> bytes:
        if self.pos + n > self.n:
            raise self._short(self.pos + n)
        out = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return out

    def string(self) -> str:
        return self.raw(self.take("Q")).decode("utf-8", errors="replace")

    def skip_strings(self, count: int) -> None:
        buf, pos, n = self.buf, self.pos, self.n
        for _ in range(count):
            if pos + 8 > n:
                self.pos = pos
                raise self._short(pos + 8)
            pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        if pos > n:
            raise self._short(pos)
        self.pos = pos

    def strings(self, count: int) -> list[str]:
        buf, pos, n, out = self.buf, self.pos, self.n, []
        unpack = struct.unpack_from
        for _ in range(count):
            if pos + 8 > n:
                raise self._short(pos + 8)
            k = unpack("<Q", buf, pos)[0]
            pos += 8
            if pos + k > n:
                raise self._short(pos + k)
            out.append(bytes(buf[pos:pos + k]).decode("utf-8", errors="replace"))
            pos += k
        self.pos = pos
        return out


def _array(c: _Cursor, keep: bool, head: int):
    etype, count = c.take("I"), c.take("Q")
    tname = f"array[{_TYPE_NAMES.get(etype, etype)}]"
    if etype in _NUMPY:
        size = np.dtype(_NUMPY[etype]).itemsize * count
        if c.pos + size > c.n:
            raise c._short(c.pos + size)
        values = np.frombuffer(c.buf, dtype=_NUMPY[etype], count=count, offset=c.pos).copy() if count else \
            np.zeros(0, _NUMPY[etype])
        c.pos += size
        return (values if keep else ArrayPreview(tname, count, tuple(values[:head].tolist()))), tname
    if etype == _STRING:
        if keep:
            return c.strings(count), tname
        start = c.pos
        first = c.strings(min(head, count))
        c.pos = start
        c.skip_strings(count)
        return ArrayPreview(tname, count, tuple(first)), tname
    if etype == _ARRAY:  # arrays of arrays: rare; kept as nested previews
        items = [_array(c, False, head)[0] for _ in range(count)]
        return ArrayPreview(tname, count, tuple(items[:head])), tname
    raise BadModelFile(f"{c.name}: unknown GGUF array element type {etype}")


def _value(c: _Cursor, vtype: int, keep: bool, head: int):
    if vtype in _SCALAR:
        return c.take(_SCALAR[vtype]), _TYPE_NAMES[vtype]
    if vtype == _STRING:
        return c.string(), "string"
    if vtype == _ARRAY:
        return _array(c, keep, head)
    raise BadModelFile(f"{c.name}: unknown GGUF value type {vtype}")


def parse_header(buf, *, name: str, file_size: int | None = None, keep=KEEP_TOKENS, head: int = 8) -> GGUFHeader:
    """The header held in `buf` (bytes or a memory map starting at the file's first byte)."""
    c = _Cursor(buf, name)
    if c.n < 4:
        raise HeaderTruncated(f"{name}: too short to be a GGUF file", need=1 << 16) if c.n else \
            BadModelFile(f"{name}: empty file, not a GGUF model")
    if bytes(buf[:4]) != b"GGUF":
        raise BadModelFile(f"{name}: not a GGUF file (it does not start with 'GGUF')")
    c.pos = 4
    version = c.take("I")
    if version not in (2, 3):
        raise BadModelFile(f"{name}: GGUF version {version} is not supported (expected 2 or 3)")
    n_tensors, n_kv = c.take("Q"), c.take("Q")
    if n_tensors > 1 << 24 or n_kv > 1 << 24:
        raise BadModelFile(f"{name}: implausible GGUF header ({n_tensors} tensors, {n_kv} keys): damaged file")
    meta, types = {}, {}
    keep = frozenset(keep)
    for _ in range(n_kv):
        key = c.string()
        meta[key], types[key] = _value(c, c.take("I"), key in keep, head)
    tensors = []
    for _ in range(n_tensors):
        tname = c.string()
        ndim = c.take("I")
        if ndim > 8:
            raise BadModelFile(f"{name}: tensor {tname} has {ndim} dimensions: damaged header")
        shape = tuple(c.take("Q") for _ in range(ndim))
        tensors.append(TensorInfo(tname, shape, c.take("I"), c.take("Q")))
    align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    align = int(align) if isinstance(align, int) and align > 0 else DEFAULT_ALIGNMENT
    data_offset = -(-c.pos // align) * align
    return GGUFHeader(name=name, version=version, metadata=meta, types=types, tensors=tuple(tensors),
                      data_offset=data_offset, file_size=file_size)


_RECENT: dict[tuple, tuple[int, GGUFHeader]] = {}  # file identity -> (CRC-32 of the header bytes, header)
_RECENT_MAX = 8
_RECENT_LOCK = threading.Lock()


def read_header(path: str | Path, *, keep=KEEP_TOKENS, head: int = 8) -> GGUFHeader:
    """The header of the .gguf file at `path`; raises BadModelFile. A header read without arrays (keep=()) is
    kept for the same file: a model load reads it from the planner, the llama.cpp probe and the runtime, and
    skipping a 150k-token vocabulary takes tens of milliseconds each time. A kept header is returned again only
    while the file's identity (path, inode, size, modification time) and its header bytes (their CRC-32, a
    millisecond for 6 MB) are unchanged."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            size = st.st_size
            if size == 0:
                raise BadModelFile(f"{path.name}: empty file, not a GGUF model")
            key = None if keep else (str(path.resolve()), st.st_ino, size, st.st_mtime_ns, head)
            with _RECENT_LOCK:
                hit = _RECENT.get(key) if key else None
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                if hit is not None:
                    with memoryview(buf) as view:
                        if zlib.crc32(view[:hit[1].data_offset]) == hit[0]:
                            return hit[1]
                header = parse_header(buf, name=path.name, file_size=size, keep=keep, head=head)
                if key:
                    with memoryview(buf) as view:
                        crc = zlib.crc32(view[:header.data_offset])
    except OSError as e:
        raise BadModelFile(f"cannot read {path}: {e.strerror or e}") from e
    if key:
        with _RECENT_LOCK:
            _RECENT[key] = (crc, header)
            while len(_RECENT) > _RECENT_MAX:
                del _RECENT[next(iter(_RECENT))]  # the oldest first
    return header


def _jsonable(value, max_items: int, max_chars: int, type_name: str = "array"):
    if isinstance(value, str):
        return value if len(value) <= max_chars else value[:max_chars] + f"... ({len(value)} characters)"
    if isinstance(value, ArrayPreview):
        items = [_jsonable(v, max_items, max_chars) for v in value.head[:max_items]]
        return {"type": value.type, "count": value.count, "first": items}
    if isinstance(value, np.ndarray):
        return {"type": f"array[{value.dtype}]", "count": int(value.size), "first": value[:max_items].tolist()}
    if isinstance(value, list):
        return {"type": type_name, "count": len(value), "first": [_jsonable(v, max_items, max_chars)
                                                                 for v in value[:max_items]]}
    if isinstance(value, (np.generic,)):
        return value.item()
    return value


def metadata_card(header: GGUFHeader, *, max_items: int = 8, max_chars: int = 400) -> dict:
    """Every metadata key with a JSON-friendly value: long strings cut at `max_chars`, arrays as
    {type, count, first: up to `max_items` items}."""
    return {k: _jsonable(v, max_items, max_chars, header.types.get(k, "array")) for k, v in header.metadata.items()}
