"""Unique-path evaluation (spec §16.1): a `Context` wrapper that scores each distinct token sequence once.

Beam sampling with replacement makes identical rows, and i.i.d. drafts repeat (parent, token) pairs; equal
sequences have equal logits, so the wrapper feeds the inner context only the first entry of every content
key and hands the same logits row to every entry that has it. The caller sees the protocol unchanged: one
logits row per entry, in order, and its own node numbering.

Content keys are small ints: a row's committed tokens get a key when they are made (prefill, truncate,
commit), and a sequence extended by one token gets the key interned for (its key, token), so equal keys
always mean equal sequences. Every pending key that was fed has a *location* in the inner context, an inner
(row, node) whose content it is (node ROOT: the row's committed tokens plus its fed suffix), and the logits
the inner returned for it. Duplicate rows commit as repeated inner rows (llama.cpp shares the cells,
PyTorch duplicates them by a row gather). Where two rows' suffixes share a first token but not the rest (a
draft after a full pass), the suffix is cut there and the rest goes in as nodes, so the shared token is fed
once; a row whose inner row is taken gets its suffix as nodes too.

Both classes count query tokens (the entries asked for: suffix tokens + nodes) and distinct tokens (what
the inner context was fed) per `evaluate` (`last_query`, `last_distinct`) and in total.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from backends.base import ROOT, AcceptedPath, ContentKeys, Context, Forest, Logits, host_rows


class CountingContext:
    """A pass-through `Context` that counts the tokens each `evaluate` asks for (all of them are fed)."""

    def __init__(self, ctx: Context) -> None:
        self.inner = ctx
        if hasattr(ctx, "output_views"):  # a reused llama.cpp context: its rows reach the caller, as copies
            ctx.output_views = False
        self.evaluations = 0
        self.query_tokens = self.distinct_tokens = 0  # totals over every evaluate
        self.last_query = self.last_distinct = 0  # the latest evaluate
        self.passes: dict[int, int] = {}  # distinct tokens fed -> evaluate calls that fed that many
        self.pass_s = 0.0  # seconds inside the inner context's evaluate (the passes themselves)
        self.pass_times: dict[int, list[float]] = {}  # distinct tokens fed -> each such pass's seconds
        self._timed: float | None = None  # the latest inner pass's seconds, until it is counted

    def _count(self, query: int, distinct: int) -> None:
        self.evaluations += 1
        self.query_tokens += query
        self.distinct_tokens += distinct
        self.last_query, self.last_distinct = query, distinct
        self.passes[distinct] = self.passes.get(distinct, 0) + 1
        if self._timed is not None and distinct > 0:
            self.pass_times.setdefault(distinct, []).append(self._timed)
        self._timed = None

    def _inner_evaluate(self, forest: Forest) -> Logits:
        t0 = time.perf_counter()
        try:
            return self.inner.evaluate(forest)
        finally:
            self._timed = time.perf_counter() - t0
            self.pass_s += self._timed

    def counters(self) -> dict[str, float | int]:
        """Per-evaluate means and totals, for the engine's stats."""
        n = max(1, self.evaluations)
        return {"evaluations": self.evaluations, "query_tokens": self.query_tokens,
                "distinct_tokens": self.distinct_tokens, "query_tokens_per_pass": self.query_tokens / n,
                "distinct_tokens_per_pass": self.distinct_tokens / n,
                "passes_by_tokens": dict(sorted(self.passes.items())), "pass_s": self.pass_s,
                "pass_s_by_tokens": {n: float(np.median(t)) for n, t in sorted(self.pass_times.items())}}

    @property
    def rows(self) -> int:
        return self.inner.rows

    def lengths(self) -> list[int]:
        return self.inner.lengths()

    def tokens(self, row: int) -> list[int]:
        return self.inner.tokens(row)

    def prefill(self, ids: Sequence[int]) -> None:
        self.inner.prefill(ids)

    def evaluate(self, forest: Forest) -> Logits:
        out = self._inner_evaluate(forest)
        n = sum(map(len, forest.suffix)) + len(forest.tokens)
        self._count(n, n)
        return out

    def commit(self, paths: Sequence[AcceptedPath]) -> None:
        self.inner.commit(paths)

    def truncate(self, n: int) -> None:
        self.inner.truncate(n)

    def kv_bytes(self) -> int:
        return self.inner.kv_bytes()

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str):  # runtime extras (max_tokens, n_batch, ...) read through
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Rows:
    """One evaluate's logits read in place, [n, vocab]: row i is a view of the inner results, nothing is copied
    until read. Valid until the wrapper's next call (evaluate, commit, prefill, truncate): a read through it
    after that raises, since the next pass may overwrite or free the cells its views show. `np.asarray(rows)`
    and `take` copy; `rows[i]` is a view, for immediate use."""

    ndim = 2

    def __init__(self, up: "UniquePaths", where: list[tuple[int, int]], vocab: int, dtype) -> None:
        self._up, self._arrays, self._where, self._epoch = up, up._arrays, where, up._epoch
        self.shape, self.dtype = (len(where), vocab), dtype  # a numpy dtype, or a torch one for device rows

    def __len__(self) -> int:
        return len(self._where)

    def _live(self) -> None:
        if self._up._epoch != self._epoch:
            raise RuntimeError("these logits were read after the context's next call; copy the rows you keep")

    def row(self, i: int) -> np.ndarray:
        self._live()
        a, k = self._where[i]
        return self._arrays[a][k]

    def block(self) -> np.ndarray | None:
        """Every row as one [n, vocab] view where they lie in order in one inner result (else None), for
        immediate use: unlike `row` and `take`, a read through it after the next call is not caught."""
        self._live()
        if not self._where:
            return None
        a, k = self._where[0]
        if all(w == (a, k + j) for j, w in enumerate(self._where)):
            return self._arrays[a][k:k + len(self._where)]
        return None

    def lie(self, idx) -> tuple[np.ndarray, list[int]] | None:
        """(the inner result, the rows' positions in it) where rows idx all lie in one inner result (else None),
        for immediate use: like `block`, a read through it after the next call is not caught."""
        self._live()
        where = [self._where[int(i)] for i in idx]
        if not where or any(a != where[0][0] for a, _ in where):
            return None
        return self._arrays[where[0][0]], [k for _, k in where]

    def take(self, idx):
        """Rows idx, copied: [len(idx), vocab], where the rows are (a device's rows stay on it)."""
        idx = list(idx)
        if not isinstance(self.dtype, np.dtype):  # tensors: the copy stays on their device
            out = self._arrays[self._where[0][0]].new_empty((len(idx), self.shape[1]))
        else:
            out = np.empty((len(idx), self.shape[1]), dtype=self.dtype)
        for j, i in enumerate(idx):
            out[j] = self.row(int(i))
        return out

    def __getitem__(self, i):
        if isinstance(i, slice):
            sub = Rows(self._up, self._where[i], self.shape[1], self.dtype)
            sub._arrays, sub._epoch = self._arrays, self._epoch
            return sub
        if isinstance(i, tuple):
            r, t = i
            return self.row(int(r))[t]
        if np.ndim(i):
            return self.take(np.asarray(i).reshape(-1))
        return self.row(int(i))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = host_rows(self.take(range(len(self))))
        return out if dtype is None else out.astype(dtype)


class UniquePaths(CountingContext):
    """Feeds `ctx` each distinct content key of the pending forest once (roots and nodes, across calls).

    Expects `ctx` to have no pending forest when wrapped (a fresh context, or one whose next call is
    prefill / truncate / commit); committed rows are read with `ctx.tokens(row)`. `views`: evaluate returns
    `Rows` (logits read in place, valid until the next call) instead of copies, for a caller that reads each
    evaluate's rows before its next call, as the decoders read the target's.
    """

    def __init__(self, ctx: Context, *, views: bool = False) -> None:
        super().__init__(ctx)
        self.views = views
        self.partial = bool(getattr(ctx, "partial_outputs", False))  # ctx returns only the nodes asked for
        self._epoch = 0  # bumped by every call: a `Rows` of an earlier one no longer reads
        self._keys = ContentKeys()
        if hasattr(ctx, "output_views"):  # llama.cpp: read its output rows in place; _detach copies what is kept
            ctx.output_views = True
        read = getattr(ctx, "tokens", None)  # rows of unknown content get keys of their own until a prefill
        rows = [list(read(r)) if read else None for r in range(ctx.rows)]
        self._set_rows([r or [] for r in rows], None if read else [self._keys.fresh() for _ in rows])

    def _set_rows(self, tokens: list[list[int]], keys: list[int] | None = None) -> None:
        """Committed rows (inner rows hold the same tokens) and an empty pending forest."""
        if keys is None:  # equal tokens, equal key
            seen: dict[tuple[int, ...], int] = {}
            keys = []
            for t in tokens:
                if tuple(t) not in seen:
                    seen[tuple(t)] = self._keys.fresh()
                keys.append(seen[tuple(t)])
        self._tokens, self._ckey = tokens, keys
        self._epoch += 1
        n = len(tokens)
        self._suffix: list[list[int]] = [[] for _ in range(n)]  # the caller's pending suffix per row
        self._rkey = list(keys)  # key of committed tokens + the caller's suffix
        self._has_nodes = [False] * n  # the caller hung nodes off this row (its suffix came first)
        self._ifed = [False] * n  # the inner row got a suffix since the commit
        self._ibusy = [False] * n  # the inner row carries nodes (its suffix can no longer be fed)
        self._inode: list[tuple[int, int]] = []  # inner node id -> (inner row, inner parent)
        self._at: dict[int, tuple[int, int, int, int]] = {}  # pending key -> (row, node, array, index)
        self._placed: dict[int, tuple[int, int]] = {}  # pending key fed without logits -> (row, node)
        self._arrays: list[np.ndarray] = []  # the inner logits of every evaluate since the commit
        self._owned = 0  # _arrays[:_owned] are copies; the rest may be views of the inner's output buffer
        self._nodes: list[tuple[int, int, int, int]] = []  # caller node id -> (key, row, parent, token)

    def _committed_at(self, key: int, row: int, ifed: list[bool]) -> tuple[int, int] | None:
        """An inner row whose committed tokens alone have `key`: `row` itself if unfed, else a twin."""
        for r in [row] + list(range(len(self._ckey))):
            if self._ckey[r] == key and not ifed[r]:
                return r, ROOT
        return None

    # -- protocol --------------------------------------------------------------------------------------
    def tokens(self, row: int) -> list[int]:
        return list(self._tokens[row])

    def prefill(self, ids: Sequence[int]) -> None:
        self.inner.prefill(ids)
        self._keys.forget()
        self._set_rows([[int(t) for t in ids]])

    def truncate(self, n: int) -> None:
        self.inner.truncate(n)
        self._set_rows([t[:n] for t in self._tokens])

    def evaluate(self, forest: Forest) -> Logits:
        if self._one_token(forest):
            return self._step(int(forest.suffix[0][0]))
        self._check(forest)
        self._epoch += 1
        plan = _Plan(self)  # works on copies: nothing changes unless the inner evaluate succeeds
        plan.add_suffixes(forest.suffix)
        plan.add_nodes(forest)
        out = plan.feed()
        self._apply(plan, forest, out)
        query = sum(map(len, forest.suffix)) + len(forest.tokens)
        self._count(query, sum(map(len, plan.isuffix)) + len(plan.itok))
        if not plan.asked:
            return out
        rows = self._gather(plan.asked)
        root_rows = tuple(r for r, s in enumerate(forest.suffix) if s)
        k = len(root_rows)
        return Logits(root_rows, rows[:k], rows[k:])

    def _one_token(self, forest: Forest) -> bool:
        """Whether `forest` is a plain step: one token after the only row's commit, no nodes, nothing fed since."""
        return (len(self._tokens) == 1 and len(forest.suffix) == 1 and len(forest.suffix[0]) == 1
                and not forest.tokens and not self._ifed[0] and not self._ibusy[0] and not self._suffix[0]
                and not self._nodes)

    def _step(self, token: int) -> Logits:
        """`evaluate` of a plain step without planning: its content key is new (nothing is scored since the
        commit), so the token goes to the inner row as its suffix; the state after is the plan's."""
        self._epoch += 1
        key = self._keys.child(self._rkey[0], token)
        self._detach()
        out = self._inner_evaluate(Forest(suffix=((token,),)))
        self._ifed[0] = True
        self._rkey[0] = key
        self._suffix[0].append(token)
        a = len(self._arrays)
        self._arrays += [out.roots, out.nodes]
        self._at[key] = (0, ROOT, a, 0)
        self._count(1, 1)
        rows = self._gather([key])
        return Logits((0,), rows, rows[1:])

    def _check(self, forest: Forest) -> None:
        n_rows = len(self._tokens)
        if len(forest.suffix) > n_rows:
            raise ValueError(f"Forest.suffix has {len(forest.suffix)} entries for {n_rows} rows")
        base = len(self._nodes)
        for i, (par, r) in enumerate(zip(forest.parents, forest.rows)):
            if not 0 <= r < n_rows:
                raise ValueError(f"node {base + i}: row {r} out of range (rows={n_rows})")
            if par != ROOT and not (0 <= par < base + i and
                                    (self._nodes[par][1] if par < base else forest.rows[par - base]) == r):
                raise ValueError(f"node {base + i}: parent {par} is not an earlier pending node of row {r}")
        for r, suf in enumerate(forest.suffix):
            if suf and self._has_nodes[r]:
                raise ValueError(f"row {r} already has pending nodes; its suffix must come before them")

    def _apply(self, plan: _Plan, forest: Forest, out: Logits | None) -> None:
        """The planned state becomes the wrapper's; the inner logits are kept for every key fed now."""
        self._ifed, self._ibusy, self._rkey = plan.ifed, plan.ibusy, plan.rkey
        for r, suf in enumerate(forest.suffix):
            self._suffix[r].extend(int(t) for t in suf)
        for _, r, _, _ in plan.new_nodes:
            self._has_nodes[r] = True
        self._nodes.extend(plan.new_nodes)
        self._inode.extend(zip(plan.irow, plan.ipar))
        self._placed.update(plan.placed)
        if out is not None:
            a = len(self._arrays)
            self._arrays += [out.roots, out.nodes]
            for key, (row, node, kind, i) in plan.fresh.items():
                self._at[key] = (row, node, a + (kind == "nodes"), i)

    def _detach(self) -> None:
        """Before the inner context decodes again: copy the rows kept from its earlier evaluates (a view of
        its output buffer would change under them). The target's one pass per commit is never copied whole;
        the caller gets only its rows, copied once by _gather."""
        if getattr(self.inner, "output_views", False):  # other runtimes return fresh arrays every pass
            for a in range(self._owned, len(self._arrays)):
                self._arrays[a] = np.array(self._arrays[a])
        self._owned = len(self._arrays)

    def _gather(self, keys: list[int]):
        """The logits of `keys`, one row each ([len(keys), vocab]): `Rows` in place with `views`, else copied out
        of the inner results."""
        first = self._arrays[self._at[keys[0]][2]]
        rows = Rows(self, [self._at[key][2:] for key in keys], first.shape[1], first.dtype)
        return rows if self.views else rows.take(range(len(rows)))

    def commit(self, paths: Sequence[AcceptedPath]) -> None:
        n_rows = len(self._tokens)
        inner_paths, tokens, keys = [], [], []
        for path in paths:
            if not 0 <= path.row < n_rows:
                raise ValueError(f"path row {path.row} out of range (rows={n_rows})")
            prev = ROOT
            for nid in path.nodes:
                if not 0 <= nid < len(self._nodes) or self._nodes[nid][1] != path.row or self._nodes[nid][2] != prev:
                    raise ValueError(f"path {path}: node {nid} does not continue the chain from row {path.row}")
                prev = nid
            key = self._nodes[prev][0] if path.nodes else self._rkey[path.row]
            hit = self._at.get(key)
            row, node = (hit[0], hit[1]) if hit else self._committed_at(key, path.row, self._ifed)
            chain = []
            while node != ROOT:
                chain.append(node)
                node = self._inode[node][1]
            inner_paths.append(AcceptedPath(row, tuple(chain[::-1])))
            tokens.append(self._tokens[path.row] + self._suffix[path.row] + [self._nodes[n][3] for n in path.nodes])
            keys.append(key)
        self.inner.commit(inner_paths)
        self._set_rows(tokens, keys)


class _Plan:
    """What one `UniquePaths.evaluate` feeds the inner context, worked out on copies of the wrapper's state."""

    def __init__(self, up: UniquePaths) -> None:
        self.up = up
        self.ifed, self.ibusy, self.rkey = list(up._ifed), list(up._ibusy), list(up._rkey)
        self.fresh: dict[int, tuple[int, int, str, int]] = {}  # key fed now -> (row, node, "roots"|"nodes", index)
        self.placed: dict[int, tuple[int, int]] = {}  # key fed now without logits -> (row, node)
        self.iout: list[bool] = []  # whether each inner node returns logits
        self.n_out = 0  # inner nodes that return logits so far
        self.isuffix: list[tuple[int, ...]] = [() for _ in up._tokens]
        self.itok: list[int] = []
        self.ipar: list[int] = []
        self.irow: list[int] = []
        self.inode0 = len(up._inode)
        self.asked: list[int] = []  # the key of every caller entry with logits: roots (row order), then nodes
        self.new_nodes: list[tuple[int, int, int, int]] = []  # as UniquePaths._nodes

    def known(self, key: int) -> bool:
        return key in self.fresh or key in self.up._at

    def where(self, key: int, row: int) -> tuple[int, int] | None:
        hit = self.fresh.get(key) or self.up._at.get(key) or self.placed.get(key) or self.up._placed.get(key)
        return (hit[0], hit[1]) if hit else self.up._committed_at(key, row, self.ifed)

    def feed_node(self, key: int, token: int, at: tuple[int, int], output: bool = True) -> tuple[int, int]:
        """An inner node for `key` under `at`; without `output` (where the inner context can skip it) its logits
        are not computed: it only carries a path, and a later call that asks for `key` feeds it again."""
        nid = self.inode0 + len(self.itok)
        output = output or not self.up.partial
        self.itok.append(int(token))
        self.ipar.append(at[1])
        self.irow.append(at[0])
        self.ibusy[at[0]] = True
        if output:
            self.fresh[key] = (at[0], nid, "nodes", self.n_out)
            self.n_out += 1
        else:
            self.placed[key] = (at[0], nid)
        self.iout.append(output)
        return at[0], nid

    def add_suffixes(self, suffix: Sequence[Sequence[int]]) -> None:
        """Each row's suffix: as an inner suffix on its own row where it can, else as nodes off the longest
        known prefix."""
        chains = {}  # row -> keys of its root and of each suffix prefix
        for r, suf in enumerate(suffix):
            if suf:
                chains[r] = keys = [self.rkey[r]]
                for t in suf:
                    keys.append(self.up._keys.child(keys[-1], int(t)))
        # A suffix prefix two rows share must be addressable (an inner row end or node) to hang the other on.
        nexts: dict[int, set[int]] = {}
        for keys in chains.values():
            for a, b in zip(keys[1:], keys[2:]):
                nexts.setdefault(a, set()).add(b)
        ends = {keys[-1] for keys in chains.values()}
        for r, keys in chains.items():
            suf = suffix[r]
            if not self.known(keys[-1]):
                # the longest known prefix (not the whole: a committed twin has no logits to hand out)
                j = max(i for i in range(len(keys) - 1) if i == 0 or self.where(keys[i], r) is not None)
                at = self.where(keys[j], r)
                if j == 0 and not self.ifed[r] and not self.ibusy[r] and not self.up._suffix[r]:  # own row
                    m = next((i for i in range(1, len(suf)) if len(nexts.get(keys[i], ())) > 1
                              or (keys[i] in ends and keys[i] in nexts)), len(suf))
                    self.isuffix[r] = tuple(int(t) for t in suf[:m])
                    self.ifed[r] = True
                    self.fresh[keys[m]] = (r, ROOT, "roots", sum(1 for s in self.isuffix if s) - 1)
                    at, j = (r, ROOT), m
                for i in range(j + 1, len(keys)):  # the rest as a chain of nodes, logits at the ends only
                    at = self.feed_node(keys[i], suf[i - 1], at, output=i == len(keys) - 1 or keys[i] in ends)
            self.rkey[r] = keys[-1]
            self.asked.append(keys[-1])

    def add_nodes(self, forest: Forest) -> None:
        """Each new node: fed as an inner node unless its content key is already scored."""
        base = len(self.up._nodes)
        for t, par, r in zip(forest.tokens, forest.parents, forest.rows):
            if par == ROOT:
                pkey = self.rkey[r]
            else:
                pkey = self.up._nodes[par][0] if par < base else self.new_nodes[par - base][0]
            key = self.up._keys.child(pkey, int(t))
            if not self.known(key):
                self.feed_node(key, t, self.where(pkey, r))
            self.new_nodes.append((key, r, par, int(t)))
            self.asked.append(key)

    def feed(self) -> Logits | None:
        """The inner evaluate of what was planned; None when every entry was scored since the commit."""
        if any(self.isuffix) or self.itok or not self.asked:
            self.up._detach()
            return self.up._inner_evaluate(Forest(suffix=tuple(self.isuffix) if any(self.isuffix) else (),
                                                  tokens=tuple(self.itok), parents=tuple(self.ipar),
                                                  rows=tuple(self.irow),
                                                  outputs=() if all(self.iout) else tuple(self.iout)))
        return None
