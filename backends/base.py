"""The protocol every model runtime implements: decoders speak in forests, backends translate.

A context holds `rows` committed sequences (one per live beam) and, between two commits, a *pending
forest*: each row's uncached suffix tokens plus draft nodes hanging off the rows. Pending nodes are
numbered 0, 1, 2, ... in the order they were evaluated since the last commit (or prefill), across
calls, so a drafter can grow the forest one layer per `evaluate` and a verifier can send it whole.

Positions (RoPE): committed token i of a row sits at position i; a row's suffix continues it; a node
at depth d (1 = child of the row's suffix) sits at `len(row) + len(suffix) + d - 1`. Siblings share
positions, so backends take positions explicitly and never derive them from cache slots.

Also here: `atomic_write`, how every file of the cache and data folders is written.
"""

from __future__ import annotations

import os
import pathlib
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence

import numpy as np

from offload.errors import BackendError, BadModelFile, OutOfMemory

__all__ = ["ROOT", "BackendError", "BadModelFile", "OutOfMemory", "Closing", "ContextFull", "ContentKeys",
           "RegistryError", "ModelNotFound", "Forest", "Logits", "host_rows", "AcceptedPath", "ModelInfo", "Context",
           "Model", "Tokenizer"]

ROOT = -1  # parent id of a node that hangs directly off its row's suffix


class ContextFull(BackendError):
    """The request needs more KV cells or rows than the context was created with."""


class RegistryError(BackendError):
    """A model could not be found, fetched or verified; the message says what to do."""


class ModelNotFound(RegistryError):
    """The source names nothing we can find (missing path, package, repo or file)."""


class ContentKeys:
    """Interned content keys (spec §16.1): equal keys are equal token sequences. A sequence gets a key of its
    own (`fresh`, or `root` by its tokens) and a sequence one token longer the key interned for (key, token)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, int], int] = {}  # (key, token) -> key of the sequence one token longer
        self._roots: dict[tuple[int, ...], int] = {}
        self._next = 0

    def fresh(self) -> int:
        self._next += 1
        return self._next

    def root(self, tokens: tuple[int, ...]) -> int:
        """The key of a whole sequence given by its tokens."""
        k = self._roots.get(tokens)
        if k is None:
            k = self._roots[tokens] = self.fresh()
        return k

    def child(self, key: int, token: int) -> int:
        k = self._ids.get((key, token))
        if k is None:
            k = self._ids[(key, token)] = self.fresh()
        return k

    def find(self, key: int, token: int) -> int | None:
        """The key of (key, token) if it was ever interned."""
        return self._ids.get((key, token))

    def forget(self) -> None:
        """Drop every interned extension and root (keys handed out stay unique: numbering goes on)."""
        self._ids.clear()
        self._roots.clear()


@dataclass(frozen=True)
class Forest:
    """What one `evaluate` call adds to the pending forest.

    suffix[r]: tokens appended to committed row r before its tree (empty when already fed since the
    last commit). tokens / parents / rows: new nodes in breadth-first order; parents[i] is ROOT or the
    id of an earlier pending node (of the same row). outputs[i]: whether node i's logits are returned (empty:
    every node's); only for a context whose `partial_outputs` is true, which then returns the rows of the nodes
    with outputs, in order (a node that only carries a path to others costs no output row).
    """

    suffix: tuple[tuple[int, ...], ...] = ()
    tokens: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    rows: tuple[int, ...] = ()
    outputs: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if not (len(self.tokens) == len(self.parents) == len(self.rows)):
            raise ValueError("Forest: tokens, parents and rows must have equal lengths")
        if self.outputs and len(self.outputs) != len(self.tokens):
            raise ValueError("Forest: outputs must be empty or have one entry per node")

    @property
    def output_flags(self) -> tuple[bool, ...]:
        """Whether each node's logits are returned: `outputs`, or every node's where it is empty."""
        return self.outputs or (True,) * len(self.tokens)


@dataclass(frozen=True)
class Logits:
    """Raw logits from one `evaluate`: `roots[i]` belongs to row `root_rows[i]` (its last suffix token).

    The rows are host numpy arrays, or tensors on the runtime's own device where the context was asked to keep
    them there (a PyTorch context's `device_rows`): the row math then reads them where they were computed, and a
    caller that needs host numbers converts them with `host_rows`."""

    root_rows: tuple[int, ...]
    roots: np.ndarray  # [len(root_rows), vocab] float32
    nodes: np.ndarray  # [n_new_nodes, vocab] float32


def host_rows(a) -> np.ndarray:
    """Logits rows as a host numpy array: a device tensor is copied to the host, anything else (numpy arrays,
    rows read in place) goes through np.asarray."""
    if hasattr(a, "detach") and hasattr(a, "cpu"):  # a torch tensor, without importing torch here
        return a.detach().cpu().numpy()
    return np.asarray(a)


@dataclass(frozen=True)
class AcceptedPath:
    """A new row after commit: source row + its suffix + the chain of pending nodes (depth order)."""

    row: int
    nodes: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelInfo:
    name: str
    backend: str  # "llamacpp" | "pytorch"
    vocab_size: int  # logits width
    n_ctx_train: int
    n_layers: int
    kv_bytes_per_token: int  # per row, all layers, K and V
    weight_bytes: int
    extra: dict = field(default_factory=dict)


class Closing:
    """`with` support for anything with a close(): runtimes' models and contexts hold native memory."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class PrefillReuse:
    """How much of a cached row a prefill keeps, so that a prompt's cache does not depend on what the context
    answered before (a seeded answer then depends only on its conversation, mode and seed).

    A cell's K and V depend on the batch that wrote it (quantized weights: the matmul kernels differ with the
    batch's shape; docs/measurements/prompt-cache.md), and a cell's place shifts summation lanes. So a prompt is
    written in chunks of `chunk` tokens aligned at position 0 into cells 0, 1, ..., as a fresh context writes
    it (an "aligned prompt"), and a later prompt keeps only whole such chunks of it. Two exceptions keep more:
    - the aligned prompt again (a regenerated answer, another mode on it): every cell of it, the cells a first
      asking leaves too;
    - a prompt that shares more than the aligned prompt with a row (a next turn of that chat, or a later turn
      edited or asked again): all it shares. That turn's answer then follows the earlier turns as answered here,
      not as a fresh context would write them.
    A kept prefix ends before the aligned prompt's end, so its next cell is in use and freed: llama.cpp then
    writes the next chunk there (it searches for free cells from the lowest one freed)."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk
        self.placed = 0  # the aligned prompt's length: its positions are in the cells of their index, in place
        self.canon = 0  # its whole chunks

    def keep(self, common: int, n: int) -> int:
        """Tokens to keep of a row sharing `common` tokens with a prompt of n tokens."""
        if common >= n == self.placed or common > self.placed:
            return common
        k = min(common, self.canon) // self.chunk * self.chunk
        return max(0, k - self.chunk) if k >= self.placed else k

    def written(self, n: int, keep: int) -> None:
        """A prefill that kept `keep` tokens has written positions up to n, in chunks from `keep`."""
        if keep % self.chunk == 0 and keep <= self.canon:  # aligned, from an aligned prefix (0 included)
            self.placed, self.canon = n, n // self.chunk * self.chunk

    def truncated(self, n: int) -> None:
        self.placed, self.canon = min(self.placed, n), min(self.canon, n // self.chunk * self.chunk)


class Context(Protocol):
    """KV state of one model for one generation at a time.

    `backends.unique.UniquePaths(ctx)` is a Context too: it feeds `ctx` each distinct sequence of the pending
    forest once (spec §16.1) and, like the pass-through `CountingContext`, counts per evaluate the query
    tokens asked for (suffix tokens + nodes) and the distinct tokens fed: `last_query`, `last_distinct`, and
    totals `query_tokens`, `distinct_tokens` over `evaluations` calls. Logits carry no counts.
    """

    @property
    def rows(self) -> int: ...

    def lengths(self) -> list[int]:
        """Committed tokens per row (suffixes and pending nodes excluded)."""

    def prefill(self, ids: Sequence[int]) -> None:
        """Make a single row holding `ids`; keeps what `PrefillReuse` allows of the row sharing the most with it."""

    def evaluate(self, forest: Forest) -> Logits:
        """Score the given suffixes and nodes in ONE forward pass; they join the pending forest."""

    def commit(self, paths: Sequence[AcceptedPath]) -> None:
        """Replace the rows by `paths`, keeping the KV of each path (rows may repeat or vanish)."""

    def truncate(self, n: int) -> None:
        """Keep the first n committed tokens of every row; drop the pending forest."""

    def kv_bytes(self) -> int:
        """KV bytes in use now (cells occupied x bytes per cell)."""

    def close(self) -> None: ...


class Tokenizer:
    """What decoders and the chat layer need from a tokenizer."""

    name: str
    n_vocab: int
    bos_id: int | None
    eos_id: int | None  # the model's declared EOS (what a chat template calls eos_token)
    eos_ids: frozenset[int]  # every end-of-generation id (EOS, EOT, ...), eos_id included
    vocab_type: str  # "bpe" | "spm" | "wpm" | "ugm" | ...
    add_bos: bool  # does the model expect BOS at the start of a prompt
    chat_template: str | None

    def encode(self, text: str, *, add_bos: bool = False, special: bool = False) -> list[int]:
        """Token ids of `text`; `special=False` tokenizes marker-like text ("<|im_end|>") as plain text."""
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> bytes:
        """Raw bytes of `ids` (may end mid-UTF-8); control tokens give b""."""
        raise NotImplementedError

    def piece(self, token: int) -> bytes:
        """The token's own text as bytes, specials rendered (used by `check_compatible`)."""
        raise NotImplementedError

    def is_eog(self, token: int) -> bool:
        return token in self.eos_ids

    def is_unused(self, token: int) -> bool:
        """True for padding / unused ids that a model never produces (allowed to differ across vocabularies)."""
        return False


class Model(Protocol):
    info: ModelInfo
    tokenizer: Tokenizer

    def context(self, *, rows: int, max_tokens: int) -> Context:
        """A KV context for up to `rows` committed rows of up to `max_tokens` tokens (tree included)."""

    def close(self) -> None: ...


def atomic_write(path: pathlib.Path, text: str) -> None:
    """Write via a temp file in the same folder + fsync + os.replace, so a crash leaves old or new, never half."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    if os.name == "posix":  # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


class _ProcStat:
    """The busy seconds of all cores from Linux's /proc/stat (its first line), read through one kept descriptor."""

    def __init__(self, fd: int) -> None:
        self._fd, self._tick = fd, 1.0 / os.sysconf("SC_CLK_TCK")

    @classmethod
    def open(cls) -> "_ProcStat | None":
        try:
            got = cls(os.open("/proc/stat", os.O_RDONLY))
        except (OSError, AttributeError, ValueError):  # not Linux
            return None
        return got if got.busy() is not None else None

    def busy(self) -> float | None:
        """user + nice + system + irq + softirq + steal, in seconds (psutil's sum less idle and iowait; guest
        time is already inside user); None if the line is not what Linux writes."""
        try:
            head = os.pread(self._fd, 512, 0).split(b"\n", 1)[0].split()
            ticks = [int(v) for v in head[1:9]]
        except (OSError, ValueError):
            return None
        if head[:1] != [b"cpu"] or len(ticks) < 8:
            return None
        return (sum(ticks) - ticks[3] - ticks[4]) * self._tick

    def __del__(self) -> None:
        try:
            os.close(self._fd)
        except (OSError, AttributeError):
            pass


class ThreadGovernor:
    """Threads for the next parallel piece of work (a llama.cpp pass, a compiled row kernel): up to `most`, one
    fewer for every core other processes keep busy.

    ggml's workers (and OpenMP's) spin at every barrier, so a worker that shares its core with another busy program
    waits for its time slice at each of the graph's hundreds of barriers: on 2 cores beside one busy process a
    1.5B pass took 3.7 s with 2 threads and 0.16 s with 1 (docs/measurements/rowmath.md). The others' load is
    read from the system's and this process's CPU times, at most every `interval` seconds.
    """

    def __init__(self, most: int, interval: float = 0.5) -> None:
        import psutil

        self.most, self.interval = max(1, most), interval
        self._psutil = psutil
        self._cores = psutil.cpu_count() or 1
        self._stat = _ProcStat.open()  # Linux: the system's CPU times read directly, not through psutil
        self._last = self._sample()
        self.current = self.most

    def _sample(self) -> tuple[float, float, float]:
        """(now, seconds every core was busy, seconds this process ran). A sample runs after a pass inside an
        answer: psutil's two calls took 0.25 ms there; /proc/stat's first line and os.times() 0.06 ms."""
        busy = self._stat.busy() if self._stat is not None else None
        if busy is None:
            t = self._psutil.cpu_times()
            busy = sum(t) - t.idle - getattr(t, "iowait", 0.0)
        own = os.times()
        return time.monotonic(), busy, own.user + own.system

    def threads(self) -> int:
        now = time.monotonic()
        if now - self._last[0] >= self.interval:
            s = self._sample()
            wall = s[0] - self._last[0]
            others = max(0.0, (s[1] - self._last[1]) - (s[2] - self._last[2])) / wall  # busy cores, not ours
            self._last = s
            self.current = max(1, min(self.most, int(self._cores - others + 0.3)))
        return self.current
