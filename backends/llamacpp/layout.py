"""Layout U bookkeeping (spec §7-8): which sequence ids each KV cell carries. Pure Python, no native calls.

Invariant: the cells of every live sequence id form ONE chain - a row's committed tokens (positions
0..L-1), its pending suffix, then pending nodes, one cell per position. llama.cpp shows a cell to a query
iff the cell carries the query's first id and sits at a position <= the query's, so a query that carries
a chain's id sees exactly its own path: committed prefix, ancestors, itself.

Growing a forest: a node under the tip of its parent's chain extends that chain (same id); any other
node starts a fresh id that gets the parent chain's cached cells up to the branch point (seq_cp over a
position range) and is added to the parent's cells that are decoded in the same batch. This is the
spec's "one id per leaf, a node carries the ids of the leaves below it", grown one call at a time. Ids in
use = rows + branch points, which is what llama.cpp's n_seq_max bounds.

Commit keeps cells, never recomputes: each new row takes an id whose chain runs through its last node,
drops the positions beyond it, and every id no row needs keeps only the longest prefix it shares with a new
row (cells left without ids are freed). Such a spare id holds cells that a row holds too, so it costs no
cell; a later branch or duplicate on it takes only the cells past that prefix. A copy or removal updates
every cell it moves (about 0.17 ms a call over a 3,500-token prompt, against a walk of about 10 us), so a
fresh id would pay for the whole prompt, and its removal again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from backends.base import ROOT, AcceptedPath, ContextFull, Forest


class Memory(Protocol):
    """The two llama_memory verbs the layout needs (positions [p0, p1), -1 = open end)."""

    def seq_rm(self, seq: int, p0: int, p1: int) -> None: ...

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None: ...


@dataclass
class _Row:
    seq: int
    tokens: list[int]  # committed: cached and kept by the last commit / prefill
    suffix: list[int] = field(default_factory=list)  # cached since the last commit, not committed


@dataclass(frozen=True)
class _Node:
    token: int
    parent: int
    row: int
    pos: int
    seq: int  # an id whose chain passes through this node


@dataclass
class Batch:
    """One llama_decode worth of tokens plus the state to install if it succeeds."""

    tokens: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    seqs: list[list[int]] = field(default_factory=list)  # first id decides what the query sees
    logits: list[bool] = field(default_factory=list)
    root_rows: list[int] = field(default_factory=list)
    copies: list[tuple[int, int, int, int]] = field(default_factory=list)  # (src, dst, p0, p1): dst holds [0, p0)
    trims: list[tuple[int, int]] = field(default_factory=list)  # (spare, p0): cut its cells from p0 before the copies
    spares: dict[int, tuple[int, int]] = field(default_factory=dict)  # spare ids taken -> (row, cells held) after trims
    nodes: list[_Node] = field(default_factory=list)
    tip: dict[int, int] = field(default_factory=dict)
    suffix: dict[int, list[int]] = field(default_factory=dict)

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        self.tokens.append(token)
        self.pos.append(pos)
        self.seqs.append([seq])
        self.logits.append(logits)
        return len(self.tokens) - 1


class LayoutU:
    """Rows, pending forest and sequence ids of one unified KV cache; starts with one empty row."""

    def __init__(self, *, n_seq: int, max_rows: int, n_vocab: int) -> None:
        self.n_seq, self.max_rows, self.n_vocab = n_seq, max_rows, n_vocab
        self._rows = [_Row(0, [])]
        self._nodes: list[_Node] = []
        self._tip: dict[int, int] = {0: ROOT}  # every live id -> last node of its chain (ROOT: the row's end)
        self._shared = [[0]]  # committed cells rows i and j have in common (a prefix)
        self._spare: dict[int, tuple[int, int]] = {}  # id no chain uses -> (row r, h): it holds r's cells [0, h)
        self.committed_cells = 0

    # -- queries ---------------------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return len(self._rows)

    def lengths(self) -> list[int]:
        return [len(r.tokens) for r in self._rows]

    def tokens(self, row: int) -> list[int]:
        return list(self._rows[row].tokens)

    @property
    def cells(self) -> int:
        """Occupied KV cells: shared committed prefixes once, plus every pending suffix token and node."""
        return self.committed_cells + sum(len(r.suffix) for r in self._rows) + len(self._nodes)

    # -- evaluate --------------------------------------------------------------------------------------
    def plan(self, forest: Forest) -> Batch:
        """The batch for `forest` (validated); nothing changes until `apply`."""
        rows, nodes, base = self._rows, self._nodes, len(self._nodes)
        if forest.suffix and len(forest.suffix) != len(rows):
            raise ValueError(f"Forest.suffix has {len(forest.suffix)} entries for {len(rows)} rows")
        b = Batch(tip=dict(self._tip))
        free = (s for s in range(self.n_seq) if s not in b.tip and s not in self._spare)
        by_row: dict[int, list[tuple[int, int]]] = {}  # row -> its spares ranked (made when a branch needs one)
        row_has_nodes = {n.row for n in nodes}
        suffix_entries: dict[int, list[int]] = {}
        for r, suf in enumerate(forest.suffix):
            if not suf:
                continue
            if r in row_has_nodes:
                raise ValueError(f"row {r} already has pending nodes; its suffix must come before them")
            start = len(rows[r].tokens) + len(rows[r].suffix)
            suf = [self._token(t) for t in suf]
            suffix_entries[r] = [b.add(t, start + j, rows[r].seq, j == len(suf) - 1) for j, t in enumerate(suf)]
            b.suffix[r] = suf
            b.root_rows.append(r)
        entry: dict[int, int] = {}  # new node id -> batch index
        get = lambda i: nodes[i] if i < base else b.nodes[i - base]  # noqa: E731
        for i, (tok, par, r, out) in enumerate(zip(forest.tokens, forest.parents, forest.rows, forest.output_flags)):
            nid = base + i
            if not 0 <= r < len(rows):
                raise ValueError(f"node {nid}: row {r} out of range (rows={len(rows)})")
            row = rows[r]
            if par == ROOT:
                pos = len(row.tokens) + len(row.suffix) + len(b.suffix.get(r, ()))
                carrier = row.seq
            else:
                if not 0 <= par < nid or get(par).row != r:
                    raise ValueError(f"node {nid}: parent {par} is not an earlier pending node of row {r}")
                pos, carrier = get(par).pos + 1, get(par).seq
            if b.tip[carrier] == par:  # parent is its chain's tip: extend the chain
                seq = carrier
            else:
                seq, held = self._branch_id(r, b, by_row, free)
                a, in_batch = par, []
                while a != ROOT and a >= base:  # walk up to the nearest cached ancestor
                    in_batch.append(a)
                    a = get(a).parent
                src, p1 = (row.seq, len(row.tokens) + len(row.suffix)) if a == ROOT else (get(a).seq, get(a).pos + 1)
                if held < p1:
                    b.copies.append((src, seq, held, p1))
                in_batch_idx = suffix_entries.get(r, []) if a == ROOT else []
                for k in in_batch_idx + [entry[x] for x in in_batch]:
                    b.seqs[k].append(seq)
            b.tip[seq] = nid
            b.nodes.append(_Node(self._token(tok), par, r, pos, seq))
            entry[nid] = b.add(b.nodes[-1].token, pos, seq, out)
        return b

    def _branch_id(self, r: int, b: Batch, by_row: dict[int, list[tuple[int, int]]], free) -> tuple[int, int]:
        """An id for a branch of row r, and how many of the row's first cells it holds: the spare sharing the
        most committed cells with the row (a fresh id when none shares any), recorded in `b`."""
        line = by_row.get(r)
        if line is None:  # (cells shared, -id), the best last: `_common`, inlined over all spares at once
            shared = self._shared
            line = by_row[r] = sorted((h if j == r else min(h, shared[j][r]), -s) for s, (j, h) in self._spare.items())
        while line and -line[-1][1] in b.spares:
            line.pop()
        held = line[-1][0] if line else 0
        seq = next(free, None) if held == 0 else None
        if seq is not None:
            return seq, 0
        if not line:
            raise ContextFull(f"the forest needs more than {self.n_seq} sequence ids (branch points + rows)")
        seq = -line.pop()[1]
        j, h = self._spare[seq]
        if h > held:
            b.trims.append((seq, held))
        b.spares[seq] = (j, held)
        return seq, held

    def _common(self, j: int, h: int, r: int) -> int:
        """Cells that an id holding row j's first h cells shares with row r's committed tokens and suffix."""
        return min(h, len(self._rows[j].tokens) + len(self._rows[j].suffix) if j == r else self._shared[j][r])

    def stage(self, b: Batch, mem: Memory) -> None:
        """The cache work a batch needs before its decode: spares cut to what they share, then the copies."""
        for seq, p0 in b.trims:
            mem.seq_rm(seq, p0, -1)
        for src, dst, p0, p1 in b.copies:
            mem.seq_cp(src, dst, p0, p1)

    def unstage(self, b: Batch, mem: Memory) -> None:
        """Undo `stage` after a failed decode: fresh ids hold nothing again, spares their shared prefix."""
        for _, dst, p0, _ in b.copies:
            mem.seq_rm(dst, p0 if dst in b.spares else -1, -1)
        for seq, (r, held) in b.spares.items():
            if held:
                self._spare[seq] = (r, held)
            else:
                del self._spare[seq]

    def apply(self, b: Batch) -> None:
        for r, suf in b.suffix.items():
            self._rows[r].suffix.extend(suf)
        self._nodes.extend(b.nodes)
        self._tip = b.tip
        for seq in b.spares:
            del self._spare[seq]

    def _token(self, t: int) -> int:
        if not 0 <= t < self.n_vocab:
            raise ValueError(f"token id {t} out of range [0, {self.n_vocab})")
        return int(t)

    # -- commit / truncate / prefill -------------------------------------------------------------------
    def commit(self, paths: Sequence[AcceptedPath], mem: Memory) -> None:
        """Rows := paths, keeping their cells; frees every cell no row holds (the other ids stay on as spares)."""
        if not paths:
            raise ValueError("commit needs at least one path")
        if len(paths) > self.max_rows:
            raise ContextFull(f"commit of {len(paths)} rows exceeds the context's {self.max_rows} rows")
        if self._keeps_its_row(paths):
            self._keep_row()
            return
        outs = []  # (source row, source id, new length, node tokens)
        for path in paths:
            if not 0 <= path.row < len(self._rows):
                raise ValueError(f"path row {path.row} out of range (rows={len(self._rows)})")
            row, prev = self._rows[path.row], ROOT
            for n in path.nodes:
                if not 0 <= n < len(self._nodes) or self._nodes[n].row != path.row or self._nodes[n].parent != prev:
                    raise ValueError(f"path {path}: node {n} does not continue the chain from row {path.row}")
                prev = n
            src = self._nodes[prev].seq if path.nodes else row.seq
            outs.append((path.row, src, len(row.tokens) + len(row.suffix) + len(path.nodes),
                         [self._nodes[n].token for n in path.nodes]))
        sources = {o[1] for o in outs}
        pool = self._pool(sources)  # ids no new row keeps as they are: (row, committed cells, cells held)
        used = sources | pool.keys()
        free = (s for s in range(self.n_seq) if s not in used)
        claimed: set[int] = set()
        new_rows = []
        for r, src, length, toks in outs:
            if src not in claimed:
                claimed.add(src)
                seq = src
            elif pool:  # a duplicated row: the id sharing most cells with it gets the rest
                seq = max(pool, key=lambda s: (self._common(*pool[s][:2], r), -s))
                j, h, held = pool.pop(seq)
                keep = self._common(j, h, r)
                if held > keep:
                    mem.seq_rm(seq, keep, -1)
                if keep < length:
                    mem.seq_cp(src, seq, keep, length)
            else:
                seq = next(free)
                mem.seq_cp(src, seq, 0, length)
            old = self._rows[r]
            new_rows.append(_Row(seq, old.tokens + old.suffix + toks))
        for path, (_, src, length, _) in zip(paths, outs):  # after all copies: cut each kept chain after its last node
            if src in claimed:
                if self._tip[src] != (path.nodes[-1] if path.nodes else ROOT):  # only where cells lie past it
                    mem.seq_rm(src, length, -1)  # (each call walks the whole cache)
                claimed.discard(src)
        spare = self._settle(pool, [p.row for p in paths], [o[2] for o in outs], mem)
        self._shared = self._commit_shared(paths, outs)
        self._rows, self._nodes, self._spare = new_rows, [], spare
        self._tip = {r.seq: ROOT for r in new_rows}
        self._recount()

    def _pool(self, keep: set[int]) -> dict[int, tuple[int, int, int]]:
        """Every id but `keep`: spares and live chains, as (row j, h, cells held) with row j's first h cells among
        them (a live chain: its row's committed tokens and suffix, then nodes of this forest)."""
        pool = {s: (j, h, h) for s, (j, h) in self._spare.items()}
        row_of = {row.seq: i for i, row in enumerate(self._rows)}
        for s, tip in self._tip.items():
            if s not in keep:
                j = row_of[s] if tip == ROOT else self._nodes[tip].row
                base = len(self._rows[j].tokens) + len(self._rows[j].suffix)
                pool[s] = (j, base, base if tip == ROOT else self._nodes[tip].pos + 1)
        return pool

    def _settle(self, pool: dict[int, tuple[int, int, int]], rows: list[int], lengths: list[int],
                mem: Memory) -> dict[int, tuple[int, int]]:
        """New spares: each id of `pool` keeps the longest prefix it shares with one of the new rows (new row i
        starts with old row rows[i] and is lengths[i] long) and loses the cells past it."""
        best: dict[int, tuple[int, int]] = {}  # old row -> (cells it shares with a new row at most, that new row)
        spare = {}
        for s, (j, h, held) in pool.items():
            if j not in best:
                base = len(self._rows[j].tokens) + len(self._rows[j].suffix)
                c, lowest = max((min(self._common(j, base, r), n), -i) for i, (r, n) in enumerate(zip(rows, lengths)))
                best[j] = c, -lowest
            c, i = best[j]
            c = min(c, h)
            if held > c:
                mem.seq_rm(s, c, -1)
            if c:
                spare[s] = (i, c)
        return spare

    def _keeps_its_row(self, paths: Sequence[AcceptedPath]) -> bool:
        """Whether `paths` is a plain step's commit: the only row with its suffix, nothing else pending."""
        return (len(paths) == 1 and len(self._rows) == 1 and len(self._tip) == 1 and not self._nodes
                and paths[0].row == 0 and not paths[0].nodes)

    def _keep_row(self) -> None:
        """`commit` of the only row with its suffix, nothing else pending: its id keeps every cell it has (none lie
        past its suffix), so no id or cell goes; the suffix joins the committed tokens."""
        row = self._rows[0]
        self._rows = [_Row(row.seq, row.tokens + row.suffix)]
        self._tip = {row.seq: ROOT}
        self._shared = [[len(self._rows[0].tokens)]]
        self.committed_cells = len(self._rows[0].tokens)

    def _commit_shared(self, paths: Sequence[AcceptedPath], outs: list) -> list[list[int]]:
        n = len(paths)
        shared = [[0] * n for _ in range(n)]
        for i in range(n):
            for j in range(n):
                pi, pj = paths[i], paths[j]
                if pi.row != pj.row:
                    s = self._shared[pi.row][pj.row]
                else:
                    row = self._rows[pi.row]
                    common = 0
                    for a, c in zip(pi.nodes, pj.nodes):
                        if a != c:
                            break
                        common += 1
                    s = len(row.tokens) + len(row.suffix) + common
                shared[i][j] = min(s, outs[i][2], outs[j][2])
        return shared

    def _recount(self) -> None:
        # Union of root paths in a tree: each row adds its length minus its longest prefix already counted.
        lens = [len(r.tokens) for r in self._rows]
        self.committed_cells = sum(lens[i] - max((self._shared[i][j] for j in range(i)), default=0)
                                   for i in range(len(lens)))

    def truncate(self, n: int, mem: Memory) -> None:
        """Keep the first n committed tokens of every row; drop the pending forest."""
        if n < 0:
            raise ValueError(f"truncate: n must be >= 0, got {n}")
        self._spare = self._settle(self._pool({r.seq for r in self._rows}), list(range(len(self._rows))),
                                   [min(n, len(r.tokens)) for r in self._rows], mem)
        for r in self._rows:
            del r.tokens[n:]
            r.suffix = []
            mem.seq_rm(r.seq, len(r.tokens), -1)
        self._nodes = []
        self._tip = {r.seq: ROOT for r in self._rows}
        self._shared = [[min(s, n) for s in line] for line in self._shared]
        self._recount()

    def start_prefill(self, ids: Sequence[int], mem: Memory,
                      keep: Callable[[int], int] | None = None) -> tuple[int, int]:
        """Keep the row sharing the longest prefix with `ids`, cut to that prefix, or to keep(prefix length)
        tokens of it when given; returns (id, tokens kept)."""
        ids = [self._token(t) for t in ids]
        best, best_n = 0, -1
        for i, r in enumerate(self._rows):
            n = 0
            for a, c in zip(r.tokens, ids):
                if a != c:
                    break
                n += 1
            if n > best_n:
                best, best_n = i, n
        if keep is not None:
            best_n = keep(best_n)
        seq = self._rows[best].seq
        self._spare = self._settle(self._pool({seq}), [best], [best_n], mem)
        mem.seq_rm(seq, best_n, -1)
        self._rows = [_Row(seq, ids[:best_n])]
        self._nodes, self._tip, self._shared = [], {seq: ROOT}, [[best_n]]
        self._recount()
        return seq, best_n

    def extend_prefill(self, ids: Sequence[int]) -> None:
        """Record tokens just decoded onto the single row."""
        self._rows[0].tokens.extend(ids)
        self._shared[0][0] = len(self._rows[0].tokens)
        self._recount()
