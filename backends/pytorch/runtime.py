"""Model / Context for the PyTorch backend: Layout R (spec §7), one KV row per committed sequence.

Row r's slots 0..L+s-1 hold its committed tokens and pending suffix at slot == position; pending
tree nodes take the row's next free slots, so a node's slot differs from its RoPE position until
`commit` compacts the accepted chain down to slot == position (keep the KV, never recompute).
"""

from __future__ import annotations

import functools
import pathlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from backends.base import (ROOT, AcceptedPath, BackendError, Closing, ContextFull, Forest, Logits, ModelInfo, OutOfMemory,
                           PrefillReuse)
from backends.pytorch.model import KVCache, Transformer
from offload.runtimes import RUNTIMES


def _typed_oom(fn):
    """torch's out-of-memory error (CUDA or host) becomes backends.base.OutOfMemory at this boundary."""
    @functools.wraps(fn)
    def wrapper(*args, **kw):
        try:
            return fn(*args, **kw)
        except torch.OutOfMemoryError as e:
            raise OutOfMemory(f"torch: {e}") from e
    return wrapper


@dataclass(frozen=True)
class _Node:
    row: int
    parent: int  # ROOT or pending node id
    depth: int
    slot: int
    token: int


class PyTorchContext(Closing):
    """Static-KV context: `max_rows` rows x `max_tokens` slots (+1 scratch slot for padded queries)."""

    prefill_chunk = RUNTIMES["pytorch"].batch  # prompt tokens per forward; bounds the [q, slots] mask and activations

    def __init__(
        self,
        model: Transformer,
        *,
        rows: int,
        max_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
        logits_dtype: type = np.float32,
    ):
        if rows < 1 or max_tokens < 1:
            raise ValueError(f"context needs rows >= 1 and max_tokens >= 1, got rows={rows}, max_tokens={max_tokens}")
        self._model, self._device, self._logits_dtype = model, device, logits_dtype
        self.max_rows, self.max_tokens = rows, max_tokens
        self._scratch = max_tokens  # padded queries write here; nothing ever attends to it
        with torch.inference_mode():
            self._kv: KVCache | None = KVCache(
                model.args, rows=rows, slots=max_tokens + 1, dtype=dtype, device=device
            )
        self._slot_bytes = self._kv.bytes_per_slot()
        # An empty context is one empty row, so a caller may start with evaluate() instead of prefill().
        self._tokens: list[list[int]] = [[]]  # committed tokens per row
        self._reuse = PrefillReuse(self.prefill_chunk)  # what a prompt keeps of the cache
        self._suffix: list[list[int]] = [[]]  # pending suffix per row (cached, not committed)
        self._used: list[int] = [0]  # next free slot per row
        self._nodes: list[_Node] = []  # pending forest, ids = list index
        # True: evaluate returns the logits as tensors on the model's device (the row math reads them there, and
        # only token ids and a few numbers reach the host); False: host numpy arrays
        self.device_rows = False

    # -- queries -----------------------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        """Where the logits are computed (and kept, with `device_rows`)."""
        return self._device

    @property
    def rows(self) -> int:
        """Rows in use now (committed sequences); the capacity is `max_rows`."""
        return len(self._tokens)

    def lengths(self) -> list[int]:
        return [len(t) for t in self._tokens]

    def tokens(self, row: int) -> list[int]:
        """Committed token ids of one row (a copy)."""
        return list(self._tokens[row])

    def kv_bytes(self) -> int:
        return sum(self._used) * self._slot_bytes

    # -- verbs -------------------------------------------------------------------------------------

    @torch.inference_mode()
    @_typed_oom
    def prefill(self, ids: Sequence[int]) -> None:
        """One row holding `ids` (all committed); keeps what `PrefillReuse` allows of the row sharing the most."""
        kv = self._live()
        ids = [int(t) for t in ids]
        if len(ids) > self.max_tokens:
            raise ContextFull(f"prompt has {len(ids)} tokens but the context holds {self.max_tokens} per row")
        best, keep = 0, 0
        for r, toks in enumerate(self._tokens):
            n = _common_prefix(toks, ids)
            if n > keep:
                best, keep = r, n
        keep = self._reuse.keep(keep, len(ids))
        if best != 0 and keep:
            for k, v in zip(kv.k, kv.v):
                k[0, :, :keep] = k[best, :, :keep]
                v[0, :, :keep] = v[best, :, :keep]
        self._tokens, self._suffix, self._used, self._nodes = [ids[:keep]], [[]], [keep], []
        self._reuse.written(keep, keep)
        for start in range(keep, len(ids), self.prefill_chunk):
            chunk = ids[start : start + self.prefill_chunk]
            n = len(chunk)
            pos = torch.arange(start, start + n, device=self._device)[None]  # [1, n]
            mask = torch.ones(n, start + n, dtype=torch.bool, device=self._device).tril(start)[None]  # [1, n, s]
            empty = torch.zeros(0, dtype=torch.long, device=self._device)
            tok = torch.tensor([chunk], dtype=torch.long, device=self._device)  # [1, n]
            self._model(tok, positions=pos, slots=pos, mask=mask, kv=kv, select=(empty, empty))
            self._tokens[0].extend(chunk)
            self._used[0] = start + n
            self._reuse.written(start + n, keep)

    @torch.inference_mode()
    @_typed_oom
    def evaluate(self, forest: Forest) -> Logits:
        """Score every row's new suffix tokens and every new node in ONE forward pass."""
        kv = self._live()
        base = len(self._nodes)
        suffix, nodes, free = self._place(forest)
        new_per_row = [f - u for f, u in zip(free, self._used)]
        if not any(new_per_row):
            empty = np.zeros((0, self._model.args.vocab_size), dtype=self._logits_dtype)
            if self.device_rows:
                empty = torch.from_numpy(empty).to(self._device)
            return Logits(root_rows=(), roots=empty, nodes=empty[:0])  # no cells: nothing to share
        block, root_rows, select = self._query_block(suffix, nodes[base:], nodes, free, new_per_row)
        out = self._forward(kv, block, select)
        # the new tokens join the pending forest.
        for r in range(self.rows):
            self._suffix[r].extend(suffix[r])
        self._used, self._nodes = free, nodes
        n_roots = len(root_rows)
        return Logits(root_rows=tuple(root_rows), roots=out[:n_roots], nodes=out[n_roots:])

    def _place(self, forest: Forest) -> tuple[list[list[int]], list[_Node], list[int]]:
        """Validate and place every new token before touching state: a rejected forest changes nothing.

        Returns the suffix per row, the pending + new nodes (id = index) and the next free slot per row.
        """
        n_rows = self.rows
        if not all(forest.outputs):
            raise ValueError("this context returns every node's logits: Forest.outputs must be empty or all true")
        if len(forest.suffix) > n_rows:
            raise ValueError(f"forest has suffixes for {len(forest.suffix)} rows but the context has {n_rows}")
        suffix = [[int(t) for t in s] for s in forest.suffix] + [[] for _ in range(n_rows - len(forest.suffix))]
        for r, s in enumerate(suffix):
            if s and any(n.row == r for n in self._nodes):
                raise ValueError(f"row {r}: suffix tokens after its tree was started (commit first)")
        base = len(self._nodes)
        nodes = list(self._nodes)
        free = [u + len(s) for u, s in zip(self._used, suffix)]
        for i, (tok, parent, row) in enumerate(zip(forest.tokens, forest.parents, forest.rows)):
            if not 0 <= row < n_rows:
                raise ValueError(f"node {base + i}: row {row} out of range (rows={n_rows})")
            if parent != ROOT and not 0 <= parent < base + i:
                raise ValueError(f"node {base + i}: parent {parent} is not an earlier pending node")
            if parent != ROOT and nodes[parent].row != row:
                raise ValueError(f"node {base + i}: parent {parent} belongs to row {nodes[parent].row}, not {row}")
            depth = 1 if parent == ROOT else nodes[parent].depth + 1
            nodes.append(_Node(row=row, parent=parent, depth=depth, slot=free[row], token=int(tok)))
            free[row] += 1
        for r, f in enumerate(free):
            if f > self.max_tokens:
                raise ContextFull(
                    f"row {r} needs {f} KV slots (committed {len(self._tokens[r])}, pending "
                    f"{self._used[r] - len(self._tokens[r])}, new {f - self._used[r]}) but the context holds "
                    f"{self.max_tokens}"
                )
        return suffix, nodes, free

    def _query_block(self, suffix, new_nodes, nodes, free, new_per_row):
        """The padded query block: row r's query j is the token written to slot used[r] + j.

        Returns (tok, pos, slot, mask) arrays, the rows with a suffix, and the (row, query) of every
        entry that needs logits: suffix ends in row order, then the new nodes.
        """
        r_fwd = 1 + max(r for r, n in enumerate(new_per_row) if n)  # trailing idle rows are left out
        used = self._used[:r_fwd]
        q, s_att = max(new_per_row), max(free[:r_fwd])  # attention covers slots 0..s_att-1
        tok = np.zeros((r_fwd, q), dtype=np.int64)
        pos = np.zeros((r_fwd, q), dtype=np.int64)
        slot = np.full((r_fwd, q), self._scratch, dtype=np.int64)
        mask = np.zeros((r_fwd, q, s_att), dtype=bool)
        mask[:, :, 0] = True  # padded queries see slot 0 only (a fully masked row would give NaN)
        root_rows, root_q = [], []
        for r in range(r_fwd):
            for j, t in enumerate(suffix[r]):
                sl = used[r] + j  # suffix slot == position
                tok[r, j], pos[r, j], slot[r, j] = t, sl, sl
                mask[r, j, : sl + 1] = True  # committed prefix, earlier suffix, itself
            if suffix[r]:
                root_rows.append(r)
                root_q.append(len(suffix[r]) - 1)
        node_q = []
        for n in new_nodes:
            r, j = n.row, n.slot - used[n.row]
            prefix = len(self._tokens[r]) + len(self._suffix[r]) + len(suffix[r])  # tokens before the tree
            tok[r, j], pos[r, j], slot[r, j] = n.token, prefix + n.depth - 1, n.slot
            mask[r, j, 0] = False
            mask[r, j, :prefix] = True
            a = n
            while True:  # itself and its ancestors, pending ones from earlier calls included
                mask[r, j, a.slot] = True
                if a.parent == ROOT:
                    break
                a = nodes[a.parent]
            node_q.append((r, j))
        select = (root_rows + [r for r, _ in node_q], root_q + [j for _, j in node_q])
        return (tok, pos, slot, mask), root_rows, select

    def _forward(self, kv: KVCache, block, select):
        """One forward; logits only where a caller needs them ([roots + nodes, vocab]), on the host or, with
        `device_rows`, where they were computed."""
        dev = self._device
        tok, pos, slot, mask = block
        sel_r, sel_q = (torch.tensor(x, dtype=torch.long, device=dev) for x in select)
        logits = self._model(
            torch.from_numpy(tok).to(dev),
            positions=torch.from_numpy(pos).to(dev),
            slots=torch.from_numpy(slot).to(dev),
            mask=torch.from_numpy(mask).to(dev),
            kv=kv,
            select=(sel_r, sel_q),
        )
        wide = torch.float64 if self._logits_dtype == np.float64 else torch.float32  # numpy has no bf16
        return logits.to(wide) if self.device_rows else logits.to(wide).cpu().numpy()

    @torch.inference_mode()
    @_typed_oom
    def commit(self, paths: Sequence[AcceptedPath]) -> None:
        """New row o = paths[o].row's committed tokens + suffix + its node chain; KV kept, compacted."""
        kv = self._live()
        if not paths:
            raise ValueError("commit needs at least one path")
        if len(paths) > self.max_rows:
            raise ContextFull(f"commit asks for {len(paths)} rows but the context holds {self.max_rows}")
        for o, p in enumerate(paths):
            if not 0 <= p.row < self.rows:
                raise ValueError(f"path {o}: row {p.row} out of range (rows={self.rows})")
            prev = ROOT
            for nid in p.nodes:
                if not 0 <= nid < len(self._nodes):
                    raise ValueError(f"path {o}: node {nid} is not pending")
                n = self._nodes[nid]
                if n.row != p.row or n.parent != prev:
                    raise ValueError(f"path {o}: nodes {tuple(p.nodes)} are not a chain from row {p.row}'s root")
                prev = nid
        src = [p.row for p in paths]
        dev = self._device
        # 1. row gather, only for rows whose source differs (the right side is copied before the write).
        moved = [o for o, r in enumerate(src) if r != o]
        if moved:
            width = max(self._used[src[o]] for o in moved)
            dst_t = torch.tensor(moved, dtype=torch.long, device=dev)
            src_t = torch.tensor([src[o] for o in moved], dtype=torch.long, device=dev)
            for k, v in zip(kv.k, kv.v):
                k[dst_t, :, :width] = k[src_t, :, :width]
                v[dst_t, :, :width] = v[src_t, :, :width]
        # 2. per-row slot gather: depth-e node -> slot L + s + e - 1, which is its RoPE position.
        rows_i, from_i, to_i = [], [], []
        for o, p in enumerate(paths):
            start = len(self._tokens[p.row]) + len(self._suffix[p.row])
            for e, nid in enumerate(p.nodes):
                if self._nodes[nid].slot != start + e:
                    rows_i.append(o)
                    from_i.append(self._nodes[nid].slot)
                    to_i.append(start + e)
        if rows_i:
            ri, fi, ti = (torch.tensor(x, dtype=torch.long, device=dev) for x in (rows_i, from_i, to_i))
            for k, v in zip(kv.k, kv.v):
                k[ri, :, ti] = k[ri, :, fi]
                v[ri, :, ti] = v[ri, :, fi]
        # 3. bookkeeping
        self._tokens = [
            self._tokens[p.row] + self._suffix[p.row] + [self._nodes[n].token for n in p.nodes] for p in paths
        ]
        self._suffix = [[] for _ in paths]
        self._used = [len(t) for t in self._tokens]
        self._nodes = []

    def truncate(self, n: int) -> None:
        """Keep the first n committed tokens of every row; drop the pending forest."""
        self._live()
        if n < 0:
            raise ValueError(f"truncate needs n >= 0, got {n}")
        self._tokens = [t[:n] for t in self._tokens]
        self._reuse.truncated(n)
        self._suffix = [[] for _ in self._tokens]
        self._used = [len(t) for t in self._tokens]
        self._nodes = []

    def close(self) -> None:
        self._kv = None

    def _live(self) -> KVCache:
        if self._kv is None:
            raise BackendError("this context is closed")
        return self._kv


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PyTorchModel(Closing):
    """A loaded transformer plus its metadata; hands out contexts."""

    def __init__(
        self,
        transformer: Transformer,
        *,
        info: ModelInfo,
        device: torch.device,
        dtype: torch.dtype,
        tokenizer_path: pathlib.Path | None = None,
    ):
        self.transformer, self.info = transformer, info
        self.device, self.dtype = device, dtype
        self._tokenizer_path, self._tokenizer = tokenizer_path, None

    @property
    def tokenizer(self):
        """backends.tokenizer.Tokenizer, loaded on first use (tests that only need ids never pay for it)."""
        if self._tokenizer is None:
            if self._tokenizer_path is None:
                raise BackendError(f"model {self.info.name!r} has no tokenizer")
            from backends.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self._tokenizer_path)
        return self._tokenizer

    @_typed_oom
    def context(self, *, rows: int, max_tokens: int, logits_dtype: type = np.float32) -> PyTorchContext:
        """A static-KV context; `logits_dtype=np.float64` keeps float64 test models' logits exact."""
        if self.transformer is None:
            raise BackendError(f"model {self.info.name!r} is closed")
        return PyTorchContext(
            self.transformer, rows=rows, max_tokens=max_tokens, device=self.device, dtype=self.dtype,
            logits_dtype=logits_dtype,
        )

    def close(self) -> None:
        self.transformer = None


def model_info(
    transformer: Transformer, *, name: str, dtype: torch.dtype, device: torch.device, extra: dict | None = None
) -> ModelInfo:
    """ModelInfo from a built transformer (bytes follow the chosen dtype)."""
    a = transformer.args
    elem = torch.empty((), dtype=dtype).element_size()
    return ModelInfo(
        name=name,
        backend="pytorch",
        vocab_size=a.vocab_size,
        n_ctx_train=a.max_seq_len,
        n_layers=a.n_layers,
        kv_bytes_per_token=2 * a.n_layers * a.n_kv_heads * a.head_dim * elem,
        weight_bytes=sum(p.numel() * p.element_size() for p in transformer.parameters()),
        extra={"arch": a.arch, "dtype": str(dtype).removeprefix("torch."), "device": str(device), **(extra or {})},
    )
