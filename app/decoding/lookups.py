"""Model-free lookup nodes (spec §16.3, §16.7): forest nodes that cost no draft pass, and the builder that
decides which of them a forest gets.

Sources (each proposes (token, evidence) children for a text, from what is fixed before the target pass):
    match     continuations of the longest suffix of the text found in the prompt (the whole conversation,
              attached files included) and in every beam of this answer, pruned ones too; several per n-gram
              with counts (prompt lookup / n-gram caches); with a `CorpusIndex`, also in earlier chats (the
              cross-chat index: the longer match of the two wins)
    recycled  the target's own top-k successors of the text's last one or two tokens, harvested from rows
              scored in earlier passes of this answer (token recycling)

The builder ranks every candidate of every root and of every node it already added by its estimated mass
in the layer's p_beam (the parent's weight times the calibrated chance of the token), adds them best
first, and keeps the prefix with the most expected beam steps per second on the target's pass-cost curve
(without costs: the best ones, up to the per-layer cap). Calibration is free: after each pass the target's
log-probs of every verified row give the true chance of each candidate proposed under it, added or not.

Exactness: a lookup node never enters a ratio or a residual; it only lets the cache rule (§16.2) pass a
layer whose every output is already a node. Everything here reads the past: the prompt, committed beams,
rows of earlier passes and counts; never this pass's logits or the layer's draws.
"""

from __future__ import annotations

import heapq
import math
from array import array
from bisect import bisect_left, bisect_right
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

SOURCES = ("match", "recycled")
MAX_NGRAM = 8  # longest suffix matched
PER_KEY = 3  # continuations proposed per text and source
RECYCLE_K = 4  # top-k successors kept per harvested row
STRENGTH = 4.0  # pseudo-observations behind each calibration prior
MIN_MASS = 1e-3  # candidates below this estimated mass are never considered
MIN_FIXED = 0.05  # without a cost curve: the smallest estimated chance worth a node
MAX_CANDIDATES = 256  # pops per forest: bounds the builder's time however rich the sources are
LAYER_STRENGTH = 1.0  # expected passes behind the prior that a lookup-only layer passes as predicted
CHAIN_START = 8  # a priced forest's model-free depth at first and after a failed chain; doubles (up to gamma)
# after a chain that passed at that depth: copying stretches grow long, and a pass scores a chain's tokens cheaply
# Priors of P(token | parent) per source and evidence, scaled by the token's share of its key's continuations:
# a match of n tokens (n-gram lookups in code and edits: short matches rarely continue, long ones usually do);
# recycled successors of a 2-token / 1-token key.
_MATCH_PRIOR = (0.0, 0.08, 0.15, 0.3, 0.45, 0.55, 0.6, 0.65, 0.7)
_RECYCLED_PRIOR = (0.0, 0.12, 0.2)
BLOCK_MIN = 256  # positions from which an added sequence is indexed as a sorted block
COUNTS_KEPT = 64  # ranges at least this wide keep their counts (bounds that memo to max_n/64 entries per position)
CORPUS_TOKENS = 200_000  # the cross-chat index's bound: the oldest chats leave beyond this many tokens
CORPUS_KEY = 2  # positions are found by the last two tokens, then matched backwards up to MAX_NGRAM
CORPUS_SCAN = 256  # positions looked at per proposal (the newest): bounds a proposal's time for common keys
# Priced searches that keep choosing no node rest the builder: 0, 1, 3, 7, ... iterations after the 1st, 2nd,
# 3rd, 4th, ... empty search in a row, at most as many as keep its own host work (proposals and pricing, about
# SEARCH_SECONDS a root: 0.27-0.47 ms an iteration of four roots on a 2-core AMD EPYC, AVX2) under IDLE_SHARE
# of an iteration's expected seconds. On a CPU pass (tens of ms or more) it never rests.
SEARCH_SECONDS = 1e-4
IDLE_SHARE = 0.02


# ------------------------------------------------------------------------------------------------- sources

class MatchIndex:
    """n-gram -> {next token: count} over the prompt and every sequence added, for suffixes of 1..MAX_NGRAM.

    A long sequence (the prompt, attached files) becomes a `_SortedContexts` block, built with numpy in
    milliseconds; the few tokens added per iteration go to a dict of every n-gram. A proposal takes the longest
    suffix found in either and adds up the counts of both, so it equals one table of every n-gram."""

    def __init__(self, max_n: int = MAX_NGRAM) -> None:
        self.max_n = max_n
        self.table: dict[tuple[int, ...], dict[int, int]] = {}
        self.blocks: list[_SortedContexts] = []

    def add(self, seq: Sequence[int], start: int = 0) -> None:
        """Index the continuation at every position i >= max(start, 1) of seq: seq[i] after seq[i-n:i]."""
        if len(seq) - max(start, 1) >= BLOCK_MIN:
            self.blocks.append(_SortedContexts(seq, max(start, 1), self.max_n))
            return
        table, seq = self.table, tuple(seq)
        for i in range(max(start, 1), len(seq)):
            nxt = seq[i]
            for n in range(1, min(self.max_n, i) + 1):
                d = table.setdefault(seq[i - n:i], {})
                d[nxt] = d.get(nxt, 0) + 1

    def propose(self, text: Sequence[int]) -> list[tuple[int, int, float]]:
        """[(token, match length, share)] for the longest indexed suffix of text, most frequent first."""
        tail = tuple(text[-self.max_n:])
        found = [(b, *b.longest(tail)) for b in self.blocks]
        n = max((m for _, m, _, _ in found), default=0)
        for k in range(len(tail), n, -1):  # a longer suffix among the small adds
            if tail[-k:] in self.table:
                n = k
                break
        if n == 0:
            return []
        parts = [b.counts(lo, hi) for b, m, lo, hi in found if m == n]
        if tail[-n:] in self.table:
            parts.append(_ranked(self.table[tail[-n:]]))
        if len(parts) > 1:
            merged: dict[int, int] = {}
            for d, _, _ in parts:
                for tok, c in d.items():
                    merged[tok] = merged.get(tok, 0) + c
            parts = [_ranked(merged)]
        _, total, best = parts[0]
        return [(tok, n, c / total) for tok, c in best]


def _ranked(counts: dict[int, int]) -> tuple[dict[int, int], int, list[tuple[int, int]]]:
    """(counts, their total, the PER_KEY most frequent (token, count), ties to the smaller token)."""
    return counts, sum(counts.values()), sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:PER_KEY]


class _SortedContexts:
    """The positions of one sequence sorted by their reversed context (the token before, then the one before
    that, ... up to max_n): the positions whose last n tokens equal a given n-gram form one contiguous range,
    found by bisecting one column per token. Padding (-1) stands where a context runs past the start."""

    def __init__(self, seq: Sequence[int], start: int, max_n: int) -> None:
        s = np.asarray(seq, dtype=np.int64)
        pos = np.arange(start, len(s))
        cols = [np.where(pos - k - 1 >= 0, s[np.maximum(pos - k - 1, 0)], -1) for k in range(max_n)]
        order = np.lexsort(cols[::-1])  # the last key sorts first: the token just before the position
        # array('q') keeps the columns compact and lets bisect read them at C speed
        self.cols = [array("q", c[order].tobytes()) for c in cols]
        self.next = array("q", s[pos[order]].tobytes())
        self._counts: dict[tuple[int, int], tuple] = {}

    def longest(self, tail: tuple[int, ...]) -> tuple[int, int, int]:
        """(n, lo, hi): the longest suffix of tail found (n tokens) and its positions' range."""
        lo, hi, n = 0, len(self.next), 0
        for k, col in enumerate(self.cols[:len(tail)]):
            tok = tail[-1 - k]
            a = bisect_left(col, tok, lo, hi)
            b = bisect_right(col, tok, a, hi)
            if a == b:
                break
            lo, hi, n = a, b, k + 1
        return n, lo, hi

    def counts(self, lo: int, hi: int) -> tuple[dict[int, int], int, list[tuple[int, int]]]:
        """`_ranked` {next token: count} over a range; kept for wide ranges (short common n-grams are asked
        often)."""
        r = self._counts.get((lo, hi))
        if r is None:
            c: dict[int, int] = {}
            for tok in self.next[lo:hi]:
                c[tok] = c.get(tok, 0) + 1
            r = _ranked(c)
            if hi - lo >= COUNTS_KEPT:
                self._counts[(lo, hi)] = r
        return r


class CorpusIndex:
    """Earlier chats' token sequences (the cross-chat index, spec §16.7: fixed before any pass of this answer),
    bounded to `max_tokens`: adding past it drops the oldest chats. A position index (last CORPUS_KEY tokens ->
    where they occur) rather than MatchIndex's table of every n-gram: about one entry per token, not eight.
    `add` with a key already held replaces that chat (a conversation that grew). Each add's positions carry
    its own number, so those of a replaced version are dead even where the new one has the same text."""

    def __init__(self, max_tokens: int = CORPUS_TOKENS, max_n: int = MAX_NGRAM) -> None:
        self.max_tokens, self.max_n = max_tokens, max_n
        self.docs: OrderedDict[object, tuple[int, ...]] = OrderedDict()
        self.where: dict[tuple[int, ...], list[tuple[object, int, int]]] = {}  # key -> [(chat, add number, i)]
        self.size = 0
        self._adds = 0
        self._live: dict[object, int] = {}  # chat -> the number of its add that holds
        self._dead = 0  # positions of dropped chats still listed in `where` (swept when they are half)

    def __len__(self) -> int:
        return self.size

    def add(self, key: object, seq: Sequence[int]) -> None:
        seq = tuple(int(t) for t in seq)[-self.max_tokens:]
        if key in self.docs:
            self._drop(key)
        self.docs[key] = seq
        self.size += len(seq)
        self._adds += 1
        self._live[key] = n = self._adds
        where, k = self.where, CORPUS_KEY
        for i in range(k, len(seq)):
            where.setdefault(seq[i - k:i], []).append((key, n, i))
        while self.size > self.max_tokens and len(self.docs) > 1:
            self._drop(next(iter(self.docs)))
        if self._dead > self.size:
            self._sweep()

    def _drop(self, key: object) -> None:
        seq = self.docs.pop(key)
        del self._live[key]
        self.size -= len(seq)
        self._dead += max(0, len(seq) - CORPUS_KEY)

    def _sweep(self) -> None:
        live = self._live
        self.where = {g: kept for g, ps in self.where.items() if (kept := [p for p in ps if live.get(p[0]) == p[1]])}
        self._dead = 0

    def propose(self, text: Sequence[int], exclude: object = None) -> list[tuple[int, int, float]]:
        """[(token, match length, share)] for the longest suffix of text (>= CORPUS_KEY tokens) found in the
        chats (not in the one keyed `exclude`: the prompt's own index holds that one), most frequent first."""
        if len(text) < CORPUS_KEY:
            return []
        tail = tuple(text[-self.max_n:])
        hits = self.where.get(tail[-CORPUS_KEY:])
        if not hits:
            return []
        best_n, found = 0, Counter()
        for doc, added, i in reversed(hits[-CORPUS_SCAN:]):
            if doc == exclude or self._live.get(doc) != added:
                continue
            seq = self.docs[doc]
            n = CORPUS_KEY
            while n < len(tail) and i - n - 1 >= 0 and seq[i - n - 1] == tail[-n - 1]:
                n += 1
            if n > best_n:
                best_n, found = n, Counter()
            if n == best_n:
                found[seq[i]] += 1
        total = sum(found.values())
        best = sorted(found.items(), key=lambda kv: (-kv[1], kv[0]))[:PER_KEY]
        return [(tok, best_n, c / total) for tok, c in best]


class Recycler:
    """The target's top-k successors of the last two / last one token(s), from rows scored in earlier passes."""

    def __init__(self, k: int = RECYCLE_K) -> None:
        self.k = k
        self.next: dict[tuple[int, ...], tuple[int, ...]] = {}

    def harvest(self, text: Sequence[int], lp: np.ndarray) -> None:
        """A scored row: `lp` = the target's log-probs after `text` (the full sequence)."""
        if len(text) == 0:
            return
        k = min(self.k, len(lp))
        top = np.argpartition(-lp, k - 1)[:k]
        top = tuple(int(t) for t in top[np.argsort(-lp[top], kind="stable")])
        self.next[tuple(text[-1:])] = top
        if len(text) >= 2:
            self.next[tuple(text[-2:])] = top

    def propose(self, text: Sequence[int]) -> list[tuple[int, int, float]]:
        for n in (2, 1):
            top = self.next.get(tuple(text[-n:])) if len(text) >= n else None
            if top:
                return [(tok, n, 1.0 / (1 + rank)) for rank, tok in enumerate(top[:PER_KEY])]
        return []


# --------------------------------------------------------------------------------------------- calibration

def _bucket(source: str, evidence: int, rank: int) -> str:
    return f"{source}:{evidence}:{min(rank, 2)}"


@dataclass
class Calibration:
    """Mean true P(token | parent) per (source, evidence, rank), learnt from verified rows; JSON-able."""

    table: dict[str, list[float]] = field(default_factory=dict)  # bucket -> [sum of p, observations]

    @staticmethod
    def prior(source: str, evidence: int, share: float) -> float:
        base = _MATCH_PRIOR if source == "match" else _RECYCLED_PRIOR
        return base[min(evidence, len(base) - 1)] * share

    def estimate(self, source: str, evidence: int, rank: int, share: float, bucket: str | None = None) -> float:
        """`bucket`: _bucket(source, evidence, rank) when the caller has it."""
        s, n = self.table.get(bucket or _bucket(source, evidence, rank), (0.0, 0.0))
        return (s + STRENGTH * self.prior(source, evidence, share)) / (n + STRENGTH)

    def observe(self, bucket: str, p: float) -> None:
        row = self.table.setdefault(bucket, [0.0, 0.0])
        row[0] += p
        row[1] += 1

    def layer_factor(self, width: int, replacement: bool) -> float:
        """Observed over predicted passes of lookup-only layers at this width and law (1 until seen): the
        per-token chances are calibrated one by one, a layer passes only when all its outputs hit together."""
        passed, predicted = self.table.get(_layer_bucket(width, replacement), (0.0, 0.0))
        return (passed + LAYER_STRENGTH) / (predicted + LAYER_STRENGTH)

    def observe_layer(self, width: int, replacement: bool, predicted: float, passed: bool) -> None:
        row = self.table.setdefault(_layer_bucket(width, replacement), [0.0, 0.0])
        row[0] += float(passed)
        row[1] += predicted

    def carried(self, cap: float = 256.0) -> "Calibration":
        """A copy with every count capped at `cap` observations (means unchanged)."""
        out = {}
        for k, (s, n) in self.table.items():
            f = min(1.0, cap / n) if n > 0 else 1.0
            out[k] = [s * f, n * f]
        return Calibration(out)


# ------------------------------------------------------------------------------------------------- builder

@dataclass(eq=False)
class Candidate:
    """A proposed node: under `parent` (a root row index at depth 1, else a Candidate or a decoder node)."""

    depth: int
    parent: object
    token: int
    source: str
    bucket: str
    est: float  # calibrated P(token | parent)
    mass: float  # est times the parent's mass: its share of the layer's p_beam when the path is reached
    text: tuple[int, ...] = ()  # the generated tokens up to and including this one


@dataclass
class LookupBudget:
    """What the builder prices: the forest before model-free nodes, per depth, and the costs."""

    max_depth: int
    width: int  # outputs a lookup-only layer draws (W_min)
    replacement: bool
    per_layer: list[int]  # free lookup slots per depth (1..max_depth)
    base_tokens: float = 0.0  # distinct tokens the target pass scores without model-free nodes
    base_seconds: float = 0.0  # the iteration's expected seconds without them
    base_pass: list[float] = field(default_factory=list)  # P(layer l passes by the drafted part), per depth


class Builder:
    """Chooses model-free nodes for each iteration and learns from every verified row (one answer's state;
    `calibration` may come from earlier answers)."""

    def __init__(self, prompt: Sequence[int], *, sources: Iterable[str] = SOURCES,
                 calibration: Calibration | None = None,
                 target_cost: Callable[[float], float] | None = None, verify_cost: float = 0.0,
                 step_cost: float = 0.0, finished: Callable[[tuple[int, ...]], bool] = lambda t: False,
                 corpus: CorpusIndex | None = None, corpus_exclude: object = None) -> None:
        """target_cost(n): seconds of a target pass scoring n tokens, never less for more tokens (None: no
        pricing, the likeliest nodes up to the cap); verify_cost: the decoder's seconds per verified layer (>= 0);
        step_cost: per iteration;
        corpus: earlier chats for the match source (not the one keyed corpus_exclude)."""
        self.prompt = tuple(prompt)
        self.sources = tuple(s for s in SOURCES if s in set(sources))
        self.calibration = calibration or Calibration()
        self.target_cost, self.verify_cost, self.step_cost = target_cost, verify_cost, step_cost
        self.finished = finished
        self.setting = None  # the caller's key for what it learns (the engine persists the calibration)
        self.index = MatchIndex() if "match" in self.sources else None
        self.recycler = Recycler() if "recycled" in self.sources else None
        if self.index is not None:
            self.index.add(self.prompt)
        self.corpus, self.corpus_exclude = None, None
        self.use_corpus(corpus, corpus_exclude)
        self.proposed: list[Candidate] = []  # this iteration's depth-1 candidates, added or not (calibration)
        self.predicted: list[float] = []  # per depth: P(the chosen nodes cover every output | layer reached),
        # from the per-token chances alone (what settle_layer weighs against the layers' outcomes)
        self.shape: LookupBudget | None = None
        self.reach = CHAIN_START  # the model-free depth a priced forest may use now (see `depth`)
        self.rest = 0  # iterations left without a search (see `rests`)
        self.empty = 0  # priced searches in a row that chose no node

    def depth(self, gamma: int) -> int:
        """How deep this iteration's model-free nodes may go: gamma without a cost curve (the fixed forest's
        shape), else the current reach, which grows while chains pass whole (`settle_chain`)."""
        return gamma if self.target_cost is None else min(gamma, self.reach)

    def settle_chain(self, built: int, passed: int) -> None:
        """An iteration's model-free part was `built` layers deep and its first `passed` layers passed: a chain
        that passed at the full reach doubles it, a failed one sets it back to CHAIN_START (past information
        only: the next forest's shape, never this one's law, spec §16.4)."""
        if built <= 0:
            return
        if passed >= built >= self.reach:
            self.reach *= 2
        elif passed < built:
            self.reach = CHAIN_START

    def rests(self) -> bool:
        """Whether this iteration goes without model-free nodes and without a search: after priced searches that
        chose none, 2^(k-1) - 1 iterations after the k-th in a row, at most as many as keep the searches' own
        seconds under IDLE_SHARE of the iterations' (past information only: the next forests' shape, never a
        law, spec §16.4)."""
        if self.rest <= 0:
            return False
        self.rest -= 1
        self.proposed, self.predicted, self.shape = [], [], None
        return True

    def _rest_after(self, chosen: bool, roots: int, seconds: float) -> int:
        """Iterations to rest after a priced search over `roots` roots, each iteration expected to take
        `seconds`."""
        self.empty = 0 if chosen else self.empty + 1
        if chosen or seconds <= 0:
            return 0
        cap = max(0, math.ceil(roots * SEARCH_SECONDS / (IDLE_SHARE * seconds)) - 1)
        return min(cap, 2 ** min(self.empty - 1, 16) - 1)

    def use_corpus(self, corpus: CorpusIndex | None, exclude: object = None) -> None:
        """Let the match source also continue text found in earlier chats (None: the prompt and beams only)."""
        self.corpus = corpus if "match" in self.sources and corpus is not None and len(corpus) else None
        self.corpus_exclude = exclude

    # -- proposals -------------------------------------------------------------------------------------
    def _match(self, full: tuple[int, ...]) -> list[tuple[int, int, float]]:
        """The match source: the prompt and beams' index, or the earlier chats' when they match longer."""
        here = self.index.propose(full)
        if self.corpus is None:
            return here
        there = self.corpus.propose(full, self.corpus_exclude)
        return there if there and (not here or there[0][1] > here[0][1]) else here

    def propose(self, text: tuple[int, ...]) -> list[tuple[int, str, str, float]]:
        """[(token, source, bucket, est)] for a parent whose generated tokens are `text`; one per token (the
        likeliest source's)."""
        full = (self.prompt[-MAX_NGRAM:] + text[-MAX_NGRAM:])[-MAX_NGRAM:]  # all any source reads
        best: dict[int, tuple[int, str, str, float]] = {}
        for source, finder in (("match", self.index), ("recycled", self.recycler)):
            if finder is None:
                continue
            found = self._match(full) if source == "match" else finder.propose(full)
            for rank, (tok, ev, share) in enumerate(found):
                bucket = _bucket(source, ev, rank)
                est = self.calibration.estimate(source, ev, rank, share, bucket)
                if tok not in best or est > best[tok][3]:
                    best[tok] = (tok, source, bucket, est)
        return sorted(best.values(), key=lambda c: (-c[3], c[0]))

    # -- the forest ------------------------------------------------------------------------------------
    def build(self, roots: Sequence[tuple[int, tuple[int, ...], float]], shape: LookupBudget,
              taken: Callable[[object, int], bool]) -> list[Candidate]:
        """Model-free nodes for one iteration, parents before children.

        roots: (row, generated tokens, weight) per distinct root content (weights sum to 1: the rows' share of
        p_beam). taken(parent, token): the layer already holds that content (a draft or a lookup node)."""
        self.proposed = []
        heap: list = []
        order = 0

        def push(parent, depth: int, text: tuple[int, ...], mass: float) -> None:
            nonlocal order
            if depth > shape.max_depth or shape.per_layer[depth - 1] <= 0:
                return
            for tok, source, bucket, est in self.propose(text):
                c = Candidate(depth, parent, tok, source, bucket, est, mass * est, text + (tok,))
                if depth == 1:
                    self.proposed.append(c)
                if c.mass < MIN_MASS or taken(parent, tok):
                    continue
                order += 1
                heapq.heappush(heap, (-c.mass, order, c))

        for row, text, weight in roots:
            if not self.finished(text):
                push(row, 1, text, weight)
        chosen: list[Candidate] = []
        used = [0] * shape.max_depth
        cover = _Coverage(shape, self.calibration.layer_factor(shape.width, shape.replacement))
        base = self.target_cost(shape.base_tokens) if self.target_cost is not None else 0.0
        best_rate, best_n = (self._rate(shape, chosen, cover.values, base) if self.target_cost else 0.0), 0
        if self.target_cost is not None and self._cannot_pay(shape, [-m for m, _, _ in heap], cover.factor, base,
                                                             best_rate):
            heap = []  # the search below would choose nothing: skip it
        pops = 0
        while heap and pops < MAX_CANDIDATES:
            _, _, c = heapq.heappop(heap)
            pops += 1
            if used[c.depth - 1] >= shape.per_layer[c.depth - 1]:
                continue
            if self.target_cost is None and c.est < MIN_FIXED:
                continue
            chosen.append(c)
            used[c.depth - 1] += 1
            if self.target_cost is not None:
                cover.add(c)
                rate = self._rate(shape, chosen, cover.values, base)
                if rate > best_rate * (1 + 1e-9):
                    best_rate, best_n = rate, len(chosen)
            if not self.finished(c.text):
                push(c, c.depth + 1, c.text, c.mass)
        if self.target_cost is not None:
            chosen = chosen[:best_n]
            self.rest = self._rest_after(bool(chosen), len(roots), shape.base_seconds)
        self.shape, self.predicted = shape, self._covered(shape, chosen, factor=1.0)
        keep = set(map(id, chosen))  # a prefix of the pop order is closed under parents
        return [c for c in sorted(chosen, key=lambda c: c.depth) if id(c) in keep]

    def _cannot_pay(self, shape: LookupBudget, masses: list[float], factor: float, base: float,
                    rate: float) -> bool:
        """True when no set of nodes can beat `rate` (the rate without them), read from the depth-1 candidates'
        masses alone. For n nodes: depth 1's coverage is at most that of the n largest masses (of at most its
        per-layer cap; the coverage only grows as nodes are added or grow), every deeper layer's at most depth
        1's (a chain passes a layer only after the ones above), and the n more tokens cost at least
        target_cost(base + n) - base (a pass-cost curve never falls as tokens are added). More nodes than the
        cap add cost and no depth-1 coverage, so n runs from 1 to the cap; the cap's coverage at one token's
        cost is tried first, as it bounds them all."""
        cap = shape.per_layer[0] if shape.per_layer else 0
        top = sorted(masses, reverse=True)[:cap] if cap > 0 else []
        bound = self._bound(shape, base)
        if not top:
            return bound(0.0, 1) <= rate
        if bound(self._coverage(shape, top, factor), 1) <= rate:
            return True
        return all(bound(self._coverage(shape, top[:n], factor), n) <= rate for n in range(1, len(top) + 1))

    @staticmethod
    def _coverage(shape: LookupBudget, top: list[float], factor: float) -> float:
        return min(1.0, factor * _all_covered(min(1.0, sum(top)), top, shape.width, shape.replacement))

    def _bound(self, shape: LookupBudget, base: float) -> Callable[[float, int], float]:
        """(h, n) -> the most steps per second n nodes whose coverage per depth is at most h could give: each depth
        l is reached with chance 1 - (1 - b_l)(1 - h) at most, b_l the drafted part's chance to pass the first l
        layers, so the steps are at most 1 + B + h (depths - B), B the sum of the b_l."""
        run_b, b_sum = 1.0, 0.0
        for l in range(shape.max_depth):
            run_b *= shape.base_pass[l] if l < len(shape.base_pass) else 0.0
            b_sum += run_b
        return lambda h, n: ((1.0 + b_sum + h * (shape.max_depth - b_sum))
                             / max(shape.base_seconds + self.target_cost(shape.base_tokens + n) - base, 1e-12))

    def _rate(self, shape: LookupBudget, chosen: Sequence[Candidate], covered: Sequence[float],
              base: float) -> float:
        """Expected beam steps per second of the iteration with these model-free nodes (spec §16.4, §16.7);
        `covered`: their coverage per depth (_Coverage.values, with the layer factor); `base`: the target
        pass's seconds without them.

        Layer l passes by the drafted part with chance base_pass[l] and by the model-free nodes when every
        output lands on one: (covered share of p_beam)^width with replacement. Each further passed layer
        costs one more verified layer (or the extra layer's warp)."""
        steps, extra_layers, run_b, run_h = 1.0, 0.0, 1.0, 1.0
        for l, h in enumerate(covered):
            run_b *= shape.base_pass[l] if l < len(shape.base_pass) else 0.0
            run_h *= h
            reach = 1.0 - (1.0 - run_b) * (1.0 - run_h)
            if reach <= 1e-9:
                break
            steps += reach
            extra_layers += reach - run_b
        seconds = (shape.base_seconds + self.target_cost(shape.base_tokens + len(chosen))
                   - base + self.verify_cost * extra_layers)
        return steps / max(seconds, 1e-12)

    def _covered(self, shape: LookupBudget, chosen: Sequence[Candidate], factor: float) -> list[float]:
        """Per depth: P(every output of the layer lands on a chosen node | the layer is reached) from the
        per-token chances, times `factor` (what lookup-only layers at this width and law did so far)."""
        cover = _Coverage(shape, factor)
        for c in chosen:
            cover.add(c)
        return cover.values

    # -- learning --------------------------------------------------------------------------------------
    def settle_layer(self, depth: int, passed: bool) -> None:
        """A verified layer of this iteration's model-free nodes alone (no drafts): what was predicted for it
        against whether it passed, so the next forests trust the per-token chances as far as layers bore them
        out."""
        if self.shape is None or not 1 <= depth <= len(self.predicted):
            return
        self.calibration.observe_layer(self.shape.width, self.shape.replacement, self.predicted[depth - 1], passed)

    def learn(self, rows: dict[tuple[int, ...], np.ndarray], nodes: Iterable[Candidate]) -> None:
        """Verified rows (generated tokens -> the target's log-probs after them): calibrate every candidate
        proposed under them (depth-1 proposals, added or not, and the added nodes) and harvest successors."""
        seen = set()
        for c in list(self.proposed) + list(nodes):
            lp = rows.get(c.text[:-1])
            if lp is None or id(c) in seen:
                continue
            seen.add(id(c))
            self.calibration.observe(c.bucket, float(math.exp(lp[c.token])))
        if self.recycler is not None:
            for text, lp in rows.items():
                self.recycler.harvest(self.prompt[-2:] + text, lp)

    def extend(self, texts: Iterable[tuple[int, ...]], old: int) -> None:
        """Index the tokens every output beam added after position `old` (pruned beams too)."""
        if self.index is None:
            return
        for text in set(texts):
            full = self.prompt[-MAX_NGRAM:] + text
            self.index.add(full, start=len(full) - (len(text) - old))


class _Coverage:
    """The coverage per depth (Builder._covered), kept current while nodes are added one at a time, parents
    first: a node changes its own depth's value and the next depth's, whose shares are taken of this depth's
    mass (the mass of the last non-empty depth before it; 1 at the roots)."""

    def __init__(self, shape: LookupBudget, factor: float) -> None:
        self.shape, self.factor = shape, factor
        self.masses: list[list[float]] = [[] for _ in range(shape.max_depth)]
        self.totals: list[float] = [0] * shape.max_depth  # sum(masses[k]), added in the same order
        self.empty = min(1.0, factor * _all_covered(0.0, [], shape.width, shape.replacement))
        self.values = [self._value(d) for d in range(shape.max_depth)]

    def add(self, c: Candidate) -> None:
        d = c.depth - 1
        self.masses[d].append(c.mass)
        self.totals[d] += c.mass
        for k in (d, d + 1):
            if k < len(self.values):
                self.values[k] = self._value(k)

    def _value(self, d: int) -> float:
        masses, shape = self.masses[d], self.shape
        if not masses:
            return self.empty
        prev_mass = 1.0  # the last non-empty depth's total before d (1 at the roots)
        for k in range(d - 1, -1, -1):
            if self.totals[k] > 0:
                prev_mass = self.totals[k]
                break
        shares = sorted((m / prev_mass for m in masses), reverse=True) if prev_mass > 0 else []
        return min(1.0, self.factor * _all_covered(min(1.0, sum(shares)), shares, shape.width, shape.replacement))


def _layer_bucket(width: int, replacement: bool) -> str:
    return f"layers:{width}:{'with' if replacement else 'without'}"


def _all_covered(cover: float, masses: Sequence[float], width: int, replacement: bool) -> float:
    """P(all `width` outputs of a layer land on nodes covering `cover` of p_beam): i.i.d. draws with
    replacement; without, sequential distinct draws, each removing at most the largest node left."""
    if cover <= 0.0 or width <= 0:
        return 0.0 if width > 0 else 1.0
    if replacement:
        return cover ** width
    out, left, removed = 1.0, cover, 0.0
    for k in range(width):
        if left <= 0:
            return 0.0
        out *= left / max(1.0 - removed, 1e-12)
        m = masses[k] if k < len(masses) else 0.0
        left -= m
        removed += m
    return max(0.0, out)
