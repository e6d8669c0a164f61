"""DSBD: dynamic-width speculative beam decoding (spec §3-§10, §16), full and memory-reduced modes.

One iteration, in the order it runs:
  1. draft   the draft beam-samples g layers of W_S pairs (with or without replacement), plus lookup nodes:
             the draft's likeliest undrawn pairs and model-free nodes (matches in the text, recycled
             predictions; app/decoding/lookups.py). Without a draft model, model-free nodes alone.
  2. score   ONE target pass over every root suffix and every forest node
  3. verify  layer by layer: multi-step speculative sampling over (beam, token) pairs, width from the acceptance
             DP; a layer passes when every output is already a forest node (the cache rule, spec §16.2)
  4. retire  finished beams join the pool; memory mode keeps one beam
  5. commit  both caches keep the KV along the kept beams' paths

Beams inside an iteration are rows of a multiset: the outputs of the previous layer in slot order, duplicates
kept, so p_beam is baseline A's (or B's) exactly. Drafts are mapped onto those rows by content (spec §16.2).
Each iteration is one `Iteration` record: its sizes, its forest, and a `LayerOutcome` per verified layer.
Statistics, the forest view and what the forest policy and the node builder learn are gathered from that record
once the iteration is decided, outside the arithmetic: phase timings by decorator, everything else in
`_Run.account`.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, Sequence

import numpy as np

from backends.base import ROOT, AcceptedPath, ContentKeys, Context, Forest

from ..config import MODE_FACTS, ConfigError, DecodeParams
from . import Step, rng_streams
from .beams import Beam, Pool, Stopper, common_prefix, final_choice
from .forest_policy import ForestPolicy, decoder_costs, lookup_layer_cost
from .inputs import pad_vocab, warp_of
from .lookups import Builder, LookupBudget
from . import rowmath
from .metrics import Metrics
from .sampling import Draft, DraftWOR, Joint, Rand, SeededRand
from .width import layer_width


# ------------------------------------------------------------------------------------------------ the forest

@dataclass(eq=False)
class Node:
    """One forest node; `up` is its parent node (None at depth 1: it hangs off root row `root`)."""

    token: int
    up: "Node | None"
    root: int
    content: int  # content key: equal keys are equal token sequences (spec §16.1)
    source: str = "draft"  # draft (the draft model) | match | recycled (model-free, app/decoding/lookups.py)
    parent: int = -1  # a draft: its parent in q's parent space (the previous layer's drafts, or the root rows)
    qval: float = 0.0  # draft: q_beam of its pair
    rest: float = 1.0  # draft: q mass not drawn before it (without replacement; 1 with replacement)
    ended: bool = False  # the path ends here (EOS / stop string): no children
    did: int | None = None  # pending node id in the draft context (None: never fed to the draft)
    tid: int = -1  # pending node id in the target context, numbered when the forest is scored
    candidate: object = None  # model-free nodes: the builder's candidate (what calibration learns from)

    def chain(self) -> tuple["Node", ...]:
        out, n = [], self
        while n is not None:
            out.append(n)
            n = n.up
        return tuple(reversed(out))


@dataclass
class Layer:
    q: Joint | None  # q_beam over (parent, token): parents = the previous layer's drafts (root rows at depth 1)
    parent_content: list[int]  # content key of each of q's parents
    drafts: list[Node]  # in draw order
    lookups: list[Node]  # lookup nodes (spec §16.3): never proposals

    @property
    def nodes(self) -> list[Node]:
        return self.drafts + self.lookups

    def first_node(self) -> dict[int, Node]:
        """content key -> the node that holds it (the lowest slot when several do)."""
        out: dict[int, Node] = {}
        for n in self.nodes:
            out.setdefault(n.content, n)
        return out


@dataclass(frozen=True)
class Handle:
    """A beam inside an iteration: root row, the forest nodes it runs through (depth order), target log-probs."""

    root: int
    chain: tuple[Node, ...]
    beam: Beam
    content: int
    lp: rowmath.LogProbRow | None  # raw target log p(. | beam) (row math's); None for an output beam


@dataclass(frozen=True)
class LayerOutcome:
    """What verification made of one layer (spec §5, §16.2)."""

    layer: Layer
    drafts: list  # the layer's drafts as tested (sampling.Draft / DraftWOR), in draw order
    outputs: list  # [(key over rows x V, index of the accepted draft or None)], W_L of them
    nodes: list  # the forest node each output landed on (None: a correction off the forest)
    by_drafts: bool  # the accepted drafts alone filled the layer
    passed: bool  # every output is a forest node: the next layer is verified on cached logits
    width: int  # W_L

    @property
    def accepted(self) -> set[int]:
        return {i for _, i in self.outputs if i is not None}

    @property
    def consumed(self) -> int:
        """Drafts tested before the layer was decided."""
        return max(self.accepted) + 1 if self.by_drafts else len(self.drafts)

    @property
    def hit(self) -> set[int]:
        """ids of the nodes a correction landed on (the cache rule's hits)."""
        return {id(n) for (_, i), n in zip(self.outputs, self.nodes) if n is not None and i is None}


@dataclass
class Iteration:
    """One iteration's record: the beams it starts from, its sizes, its forest, its layers' outcomes and the
    forest view made of them."""

    live: Sequence[Beam]
    roots: list[int]  # content key of each live beam
    contents: ContentKeys
    sized: tuple[int, int]  # distinct root query tokens in the target and the draft pass
    gamma: int
    draft_beams: int  # W_S (0: lookup nodes only)
    draft_lookups: int  # the draft model's lookup nodes per layer
    layers: list[Layer] = field(default_factory=list)
    fed: bool = False  # the draft context was evaluated (its KV holds the fed nodes)
    outcomes: list[LayerOutcome] = field(default_factory=list)
    verified_rows: dict = field(default_factory=dict)  # beam tokens -> its target row (the builder learns them)
    view_layers: list[dict] = field(default_factory=list)  # the forest view, one entry per verified layer
    shape: tuple[int, int] = (0, 0)  # (depth, W_S) as the statistics count it

    @property
    def drafted_q(self) -> Joint | None:
        """The first layer's q_beam (None: no draft-model layer): the next iteration's policy prices its
        distinct drafts on it."""
        return self.layers[0].q if self.layers else None


# lookups(depth, parent contents, previous layer's nodes or None, q_beam or None, drafts) -> [(parent, token)]:
# parent indexes the previous layer's nodes, drafts first (the root rows at depth 1); parent contents are theirs.
# Replaces the draft-model lookup nodes (tests inject sources); chosen from what is known before the layer's
# tests (spec §16.3).
Lookups = Callable[[int, list[int], Sequence[Node] | None, Joint | None, list[Node]], list[tuple[int, int]]]


def _timed(phase: str):
    """Time a phase method into metrics.phase_s[phase] (the iteration split in stats and benches)."""
    def wrap(method):
        @functools.wraps(method)
        def timed(self, *args, **kwargs):
            with self.metrics.timed(phase):
                return method(self, *args, **kwargs)
        return timed
    return wrap


# -------------------------------------------------------------------------------------------------- decoder

def dsbd(*, target: Context, draft: Context | None, prompt: Sequence[int], params: DecodeParams,
         stopper: Stopper, metrics: Metrics, vocab: int, costs=None, policy: ForestPolicy | None = None,
         nodes: Builder | None = None, lookups: Lookups | None = None,
         rands: tuple[Rand, Rand] | None = None, rm=None) -> Iterator[Step]:
    """DSBD generator; `params.mode` is "dsbd" (full) or "dsbd-mem" (one beam between iterations).

    params.replacement "with" reproduces beam sampling with replacement (baseline A), "without" conventional
    beam sampling (baseline B, spec §16.5). An adaptive forest sizes each iteration with `policy` (the engine's,
    carrying what it learnt), else one priced by `costs` = (target, draft) pass-cost curves. `draft` None: no
    draft model; the forest holds model-free lookup nodes only. `nodes` chooses the model-free nodes (default:
    a Builder over params.lookup_sources). `lookups` replaces the draft-model lookup nodes (tests). `rands` =
    (draft, verify) randomness replaces the seeded streams (tests enumerate every outcome); `rm` the row-math
    backend (default: the process's, app/decoding/rowmath.py).
    """
    run = _Run(params=params, stopper=stopper, metrics=metrics, vocab=vocab, has_draft=draft is not None,
               policy=policy or _policy(params, costs, draft),
               builder=nodes if nodes is not None else _builder(params, prompt, costs, stopper, vocab),
               lookups=lookups, rands=rands, rm=rm or rowmath.backend())
    run.prefill(target, draft, prompt)
    live, t_suffix, d_suffix = [Beam((), 0.0)], [(prompt[-1],)], [(prompt[-1],)]
    it = None
    while True:
        it = run.begin(live, t_suffix, d_suffix, after=it)                               # sizes
        run.draft(draft, it, d_suffix)                                                   # 1. draft
        root_lp, node_lp = run.score(target, t_suffix, it.layers)                        # 2. score
        rows = [Handle(r, (), b, it.roots[r], root_lp.row(r)) for r, b in enumerate(live)]
        output, stop = run.verify(it, rows, node_lp)                                     # 3. verify
        nxt, done = run.retire(output, stop)                                             # 4. retire
        run.account(target, draft, it, output, nxt)
        if done is not None:
            run.settle_draft(draft)
            yield run.finish(done)
            return
        d_suffix = run.commit(target, draft, nxt, live, d_suffix, it.fed)               # 5. commit
        live = [h.beam for h in nxt]
        t_suffix = [(b.tokens[-1],) for b in live]
        final = live[0].tokens if run.memory else common_prefix([b.tokens for b in live + run.pool.beams])
        yield Step(final=final, live=len(live), forest=run.view(it))


class _Run:
    """One generation's settings and what lasts across its iterations (the randomness, the finished pool, what
    the policy and the builder learn); one method per phase of the iteration, each iteration's state in its
    `Iteration`."""

    def __init__(self, *, params: DecodeParams, stopper: Stopper, metrics: Metrics, vocab: int, has_draft: bool,
                 policy: ForestPolicy | None, builder: Builder | None, lookups: Lookups | None,
                 rands: tuple[Rand, Rand] | None, rm) -> None:
        self.rm = rm
        self.params, self.stopper, self.metrics, self.vocab = params, stopper, metrics, vocab
        self.has_draft, self.policy, self.builder = has_draft, policy, builder
        self.lookups = lookups  # None: the draft's likeliest undrawn pairs (_top_q_lookups)
        self.draft_lookups = params.lookup_nodes if "draft" in params.lookup_sources else 0  # the most per layer
        self.memory = not MODE_FACTS[params.mode].keeps_rows
        self.without = params.replacement == "without"
        self.w, self.warp, self.lam = params.beams, warp_of(params), params.length_penalty
        self.draft_rand, self.rand = rands or tuple(SeededRand(r) for r in rng_streams(params.seed))
        self.n_extra = 1 if self.memory and params.select == "sample" else self.w
        self.pool = Pool(self.w, self.lam)
        self.draft_rows: list[int] | None = None  # while the draft idles: its context row under each live beam
        metrics.forest_policy = params.forest

    def prefill(self, target: Context, draft: Context | None, prompt: Sequence[int]) -> None:
        target.prefill(prompt[:-1])
        if draft is not None:
            draft.prefill(prompt[:-1])
        self.metrics.mark_prefilled()

    # -- sizes -----------------------------------------------------------------------------------------
    def begin(self, live: Sequence[Beam], t_suffix, d_suffix, *, after: Iteration | None) -> Iteration:
        """A new iteration from the live beams (`after` the one before, None at the start), sized by `sizes`."""
        contents = ContentKeys()
        roots = [contents.root(b.tokens) for b in live]
        sized = (sum(map(len, t_suffix)), sum(map(len, d_suffix)))
        q = after.drafted_q if after is not None else None
        return Iteration(live, roots, contents, sized, *self.sizes(live, sized, q))

    def sizes(self, live, sized: tuple[int, int], q) -> tuple[int, int, int]:
        """(gamma, W_S, draft lookup nodes per layer) of this iteration's drafted part; an adaptive policy
        decides from the past only (spec §16.4, §16.8), pricing distinct drafts on the last iteration's drafted
        q (priced once per drafted q). Without a draft model: no drafted part."""
        g = min(self.params.gamma, self.params.max_new_tokens - len(live[0].tokens) - 1)
        if not self.has_draft:
            return 0, 0, 0
        ws, n = self.params.draft_beams, self.draft_lookups
        if self.policy is not None:
            choice = self.policy.choose(max_gamma=g, roots=sized[0], draft_roots=sized[1], q_rows=q,
                                        with_lookups=True)
            g, ws = choice[:2]
            n = choice[2] if len(choice) > 2 else n
        return g, ws, n

    # -- 1. draft ----------------------------------------------------------------------------------------
    @_timed("draft")
    def draft(self, draft: Context | None, it: Iteration, suffix) -> None:
        """The forest into `it.layers`: draft beam sampling (spec §4) for up to gamma layers of W_S pairs with
        the draft model's lookup nodes, then the model-free nodes (up to the builder's depth, <= gamma)."""
        it.layers = self._drafted(draft, it, suffix) if it.gamma > 0 else []
        if self.builder is not None:
            self._model_free(it)
        it.fed = it.gamma > 0 and it.draft_beams > 0 and self.has_draft

    def _drafted(self, draft: Context, it: Iteration, suffix) -> list[Layer]:
        live, roots, contents, g, ws = it.live, it.roots, it.contents, it.gamma, it.draft_beams
        scores = np.array([b.score for b in live])
        dscore = scores - scores.max()  # seeded with target scores (spec §4, step 1), best = 0
        prev: list[Node] | None = None  # previous layer's nodes (None: the root rows)
        q_parents: list[Node] | None = None  # q's parents: the previous layer's drafts
        parent_content, ended, paths = list(roots), np.zeros(len(live), bool), [b.tokens for b in live]
        drafting = ws > 0  # W_S = 0: lookup nodes only
        if drafting:
            self.settle_draft(draft)
        logits = self._draft_pass(draft, Forest(suffix=tuple(suffix)), roots=True) if drafting else None
        lookups = self.lookups or functools.partial(_top_q_lookups, it.draft_lookups)
        layers: list[Layer] = []
        fed = 0  # pending node ids handed out in the draft context
        for l in range(1, g + 1):
            q, drafts = None, []
            if drafting:
                lq = self.rm.rows(pad_vocab(logits, self.vocab))  # [parents, V] raw draft log-probs
                q = self.rm.law(lq, np.where(ended, -np.inf, dscore), self.warp)  # an ended path has no children
                if self.without:  # distinct pairs, each with the q mass left before it (spec §16.5)
                    keys, rest = q.distinct(ws, self.draft_rand)
                else:  # i.i.d. (spec §4)
                    keys, rest = q.sample(ws, self.draft_rand), np.ones(ws)
                for k, qv, rs in zip(keys, q.lookup(keys), rest):
                    par, tok = int(k // self.vocab), int(k % self.vocab)
                    up = None if q_parents is None else q_parents[par]
                    drafts.append(Node(tok, up, par if up is None else up.root,
                                       contents.child(parent_content[par], tok), parent=par, qval=float(qv),
                                       rest=float(rs), ended=self.stopper.finished(paths[par] + (tok,))))
            looks = []
            for par, tok in lookups(l, roots if prev is None else [n.content for n in prev], prev, q, drafts):
                up = None if prev is None else prev[par]
                looks.append(Node(tok, up, par if up is None else up.root,
                                  contents.child(roots[par] if up is None else up.content, tok), parent=par))
            if not (drafts or looks):
                break  # nothing left to verify at this depth: the extra layer follows
            layers.append(Layer(q, parent_content, drafts, looks))
            if l == g:
                break
            prev = drafts + looks
            drafting = drafting and not all(n.ended for n in drafts)
            if not drafting:
                continue  # lookup nodes only from here on
            for j, n in enumerate(drafts):  # layer l is fed: it parents layer l + 1
                n.did = fed + j
            dscore = np.array([dscore[n.parent] + lq.at(n.parent, n.token) for n in drafts])  # lq: until the pass
            logits = self._draft_pass(draft, Forest(
                tokens=tuple(n.token for n in drafts),
                parents=tuple(ROOT if n.up is None else n.up.did for n in drafts),
                rows=tuple(n.root for n in drafts)))
            fed += len(drafts)
            paths = [paths[n.parent] + (n.token,) for n in drafts]
            ended = np.array([n.ended for n in drafts])
            q_parents, parent_content = drafts, [n.content for n in drafts]
        return layers

    @_timed("draft_passes")
    def _draft_pass(self, draft: Context, forest: Forest, *, roots: bool = False) -> np.ndarray:
        self.metrics.draft_passes += 1
        out = draft.evaluate(forest)
        return out.roots if roots else out.nodes

    def _model_free(self, it: Iteration) -> None:
        """Model-free lookup nodes (spec §16.7) hung off the roots and off each other, up to the builder's depth,
        where the builder's estimate says they pay (or, for a fixed forest, the likeliest up to the cap)."""
        layers, live, roots, contents = it.layers, it.live, it.roots, it.contents
        depth = min(self.builder.depth(self.params.gamma), self.params.max_new_tokens - len(live[0].tokens) - 1)
        cap = self.params.lookup_nodes
        if depth <= 0 or cap <= 0 or self.builder.rests():
            return
        per_layer = [cap - (len(layers[l].lookups) if l < len(layers) else 0) for l in range(depth)]
        held = [{n.content for n in layer.nodes} for layer in layers]
        scores = np.array([b.score for b in live])
        weights = np.exp(scores - scores.max())
        weights /= weights.sum()
        first: dict[int, tuple[int, float]] = {}  # root content -> (its first row, summed weight)
        for r, c in enumerate(roots):
            row, w = first.get(c, (r, 0.0))
            first[c] = (row, w + float(weights[r]))
        shape = LookupBudget(max_depth=depth, width=self.params.min_beams, replacement=not self.without,
                             per_layer=per_layer, **self._base_price(it))
        made: dict[int, Node] = {}  # id(candidate) -> its node

        def taken(parent, token: int) -> bool:
            if isinstance(parent, int):  # a root row at depth 1
                key = contents.find(roots[parent], token)
                return key is not None and bool(held) and key in held[0]
            return False  # under a model-free node every content is new

        picks = self.builder.build([(row, live[row].tokens, w) for row, w in first.values()], shape, taken)
        for c in picks:
            up = made.get(id(c.parent)) if not isinstance(c.parent, int) else None
            root = c.parent if up is None else up.root
            key = contents.child(roots[root] if up is None else up.content, c.token)
            node = Node(c.token, up, root, key, source=c.source, ended=self.stopper.finished(c.text),
                        candidate=c)
            made[id(c)] = node
            while len(layers) < c.depth:
                layers.append(Layer(None, [], [], []))
            layers[c.depth - 1].lookups.append(node)

    def _base_price(self, it: Iteration) -> dict:
        """What the builder adds to: the drafted forest's distinct target tokens, its expected seconds and pass
        chance per depth (from the policy; empty without costs)."""
        if self.builder.target_cost is None:
            return {}
        layers, roots, g, ws, n_look = it.layers, it.roots, it.gamma, it.draft_beams, it.draft_lookups
        distinct = len(set(roots)) + sum(len({n.content for n in L.nodes}) for L in layers)
        if self.policy is not None and g > 0:
            seconds = self.policy.seconds(g, ws, roots=it.sized[0], draft_roots=it.sized[1], lookups=n_look)
            passes = [self.policy.pass_rate(l, ws, n_look) for l in range(1, len(layers) + 1)]
        else:
            seconds, passes = self.builder.target_cost(distinct) + self.builder.step_cost, []
        return {"base_tokens": float(distinct), "base_seconds": seconds, "base_pass": passes}

    # -- 2. score ----------------------------------------------------------------------------------------
    @_timed("target")
    def score(self, target: Context, suffix, layers: list[Layer]):
        """ONE target pass over every root suffix and every node (spec §7), nodes numbered layer by layer."""
        nodes = [n for layer in layers for n in layer.nodes]
        for i, n in enumerate(nodes):
            n.tid = i
        out = target.evaluate(Forest(suffix=tuple(suffix), tokens=tuple(n.token for n in nodes),
                                     parents=tuple(ROOT if n.up is None else n.up.tid for n in nodes),
                                     rows=tuple(n.root for n in nodes)))
        self.metrics.target_passes += 1
        return self.rm.rows(out.roots), self.rm.rows(out.nodes)

    # -- 3. verify ---------------------------------------------------------------------------------------
    @_timed("verify")
    def verify(self, it: Iteration, rows: list[Handle], node_lp):
        """Layer by layer (spec §5, §6, §16.2), each layer's outcome into `it.outcomes`. Returns (output beams,
        stop now)."""
        for layer in it.layers:
            it.verified_rows.update((h.beam.tokens, h.lp) for h in rows)
            outputs, drafts, by_drafts, width = self.verify_layer(layer, rows)
            hits = layer.first_node()
            nodes = [hits.get(it.contents.find(rows[k // self.vocab].content, k % self.vocab)) for k, _ in outputs]
            passed = all(n is not None for n in nodes)
            it.outcomes.append(LayerOutcome(layer, drafts, outputs, nodes, by_drafts, passed, width))
            if not passed:  # the output layer: its tokens are the next uncached suffix (spec §8)
                return [self._extend(rows[k // self.vocab], k % self.vocab, None, drafted=i is not None)
                        for k, i in outputs], False
            beams = [self._extend(rows[k // self.vocab], k % self.vocab, n, node_lp.row(n.tid), drafted=i is not None)
                     for (k, i), n in zip(outputs, nodes)]
            ended = [self.stopper.finished(h.beam.tokens) for h in beams]
            still = [h for h, e in zip(beams, ended) if not e]
            if not self.memory:
                for h, e in zip(beams, ended):
                    if e:
                        self.pool.add(replace(h.beam, finished=True))
            if not still:  # a passed layer that leaves no live beam becomes the output layer
                return beams, False
            if not self.memory and self.pool.is_done([h.beam for h in still]):
                return still, True
            rows = still
        it.verified_rows.update((h.beam.tokens, h.lp) for h in rows)
        # every layer passed: the extra layer from the last logits (the plain step)
        picked = self._fused(rows, self.n_extra)
        if picked is not None:
            return [self._extend(rows[r], t, None, raw=raw) for r, t, raw in picked], False
        p = self._p_beam(rows)
        if self.without:
            keys = self.rm.distinct_keys(p, self.n_extra, self.rand)
        else:
            keys = p.sample(self.n_extra, self.rand)
        return [self._extend(rows[k // self.vocab], int(k % self.vocab), None) for k in keys], False

    def verify_layer(self, layer: Layer, rows: list[Handle]):
        """One layer's W_L outputs [(key over rows, draft index or None)], its drafts as tested, whether the
        drafts alone filled it, and W_L."""
        q, drafts = self._drafts_on_rows(layer, rows)
        if not drafts:  # lookup nodes only: the plain step on cached logits (spec §16.3)
            width = layer_width(np.zeros, 0, self.params.threshold, self.params.min_beams, self.w)
            picked = self._fused(rows, width)
            if picked is not None:
                return [(r * self.vocab + t, None) for r, t, _ in picked], drafts, False, width
            p = self._p_beam(rows)
            width = p.at_most(width) if self.without else width
            keys = self.rm.distinct_keys(p, width, self.rand) if self.without else p.sample(width, self.rand)
            return [(int(k), None) for k in keys], drafts, False, width
        p = self._p_beam(rows)
        chain = self.rm.chain(p, q, len(drafts))  # without replacement: alpha for the width
        width = layer_width(chain.alphas, len(drafts), self.params.threshold, self.params.min_beams, self.w)
        if self.without:
            width = p.at_most(width)  # min(width, pairs in supp(p))
            by_drafts, outputs = self.rm.verify_without(p, q, drafts, width, self.rand)
        else:
            by_drafts, outputs = self.rm.verify(chain, drafts, width, self.rand)
        return outputs, drafts, by_drafts, width

    def _drafts_on_rows(self, layer: Layer, rows: list[Handle]):
        """The layer's drafts as proposals over the rows, keyed by content (spec §16.2): a draft under content c
        goes to one of c's m rows at random, and q_rows(row, t) = (q summed over c's parents) / m, the law of
        the mapped draft. A draft whose parent content has no row is an invalid-parent draft (certain
        rejection; its q mass stays off S)."""
        if not layer.drafts:
            return None, []
        V = self.vocab
        members: dict[int, list[int]] = defaultdict(list)
        for i, h in enumerate(rows):
            members[h.content].append(i)
        by_content: dict[int, list[int]] = defaultdict(list)  # content -> q's parents holding it
        for j, c in enumerate(layer.parent_content):
            by_content[c].append(j)
        parents = [by_content.get(h.content, []) for h in rows]
        q_rows = self.rm.on_rows(layer.q, parents, [len(members[h.content]) for h in rows])
        keys, inside = [], []
        for n in layer.drafts:
            idx = members.get(layer.parent_content[n.parent], [])
            inside.append(bool(idx))
            keys.append(idx[self.draft_rand.integer(len(idx)) if len(idx) > 1 else 0] * V + n.token if idx
                        else len(rows) * V + n.token)  # outside S: q at its own draw
        looked = iter(q_rows.lookup(np.array([k for k, ok in zip(keys, inside) if ok], dtype=np.int64)).tolist())
        out: list = []
        for n, key, ok in zip(layer.drafts, keys, inside):
            qv = next(looked) if ok else n.qval
            out.append(DraftWOR(key, qv, n.rest, ok) if self.without else Draft(key, qv, ok))
        return q_rows, out

    def _fused(self, rows: Sequence[Handle], n: int):
        """The plain step's n draws over rows x V by the backend's fused step, [(row, token, raw log-prob)]: the
        keys p_beam's draws give, bit for bit (and n <= the pairs in supp(p), so no `at_most` cut applies); the
        rows keep the normalisers it computed, as `stack` leaves them. None where the backend has none or the
        general path must run."""
        step = getattr(self.rm, "beam_step", None)
        if step is None:
            return None
        return step([h.lp for h in rows], np.array([h.beam.score for h in rows]), self.warp, self.rand, n,
                    not self.without)

    def _p_beam(self, rows: Sequence[Handle]):
        """p_beam over rows x V: joint raw target log-scores, warped (spec §2.1)."""
        return self.rm.law(self.rm.stack([h.lp for h in rows]), np.array([h.beam.score for h in rows]), self.warp)

    def _extend(self, h: Handle, token: int, node: Node | None, lp=None, *, drafted: bool = False,
                raw: float | None = None) -> Handle:
        """h + token; on a node, the beam runs through that node's own path (equal content, same tokens). `raw`:
        the token's log-prob on h's row where the step read it already (`h.lp[token]`, the same float)."""
        raw = float(h.lp[token]) if raw is None else raw
        beam = Beam(h.beam.tokens + (token,), h.beam.score + raw, drafted=h.beam.drafted + (drafted,))
        if node is None:
            return Handle(h.root, h.chain, beam, -1, None)
        return Handle(node.root, node.chain(), beam, node.content, lp)

    # -- 4. retire -----------------------------------------------------------------------------------------
    def retire(self, output: list[Handle], stop: bool):
        """(beams carried to the next iteration, None) or ([], the candidates to finish with)."""
        if stop:
            return [], [h.beam for h in output]
        ended = [self.stopper.finished(h.beam.tokens) for h in output]
        if self.memory:  # carry one beam: slot 1 (an exact p_beam draw, spec §9) or the best (ties: lower slot)
            keep = 0 if self.params.select == "sample" else \
                max(range(len(output)), key=lambda i: (output[i].beam.score, -i))
            if ended[keep]:
                return [], [replace(output[keep].beam, finished=True)]
            nxt = [output[keep]]
        else:
            for h, e in zip(output, ended):
                if e:
                    self.pool.add(replace(h.beam, finished=True))
            nxt = [h for h, e in zip(output, ended) if not e]
        live = [h.beam for h in nxt]
        if not live or len(live[0].tokens) >= self.params.max_new_tokens or self.pool.is_done(live):
            return [], live
        return nxt, None

    def finish(self, candidates: Sequence[Beam]) -> Step:
        best = final_choice(self.pool.beams, candidates, self.lam)
        self.metrics.finish_reason = "stop" if best.finished else "length"
        return Step(final=best.tokens, live=0, done=True, output=best)

    # -- 5. commit -----------------------------------------------------------------------------------------
    @_timed("commit")
    def commit(self, target: Context, draft: Context | None, nxt: Sequence[Handle], live: Sequence[Beam],
               d_suffix, fed: bool):
        """Both caches keep the kept beams' paths. The draft keeps the KV of each beam's fed nodes; its other
        new tokens become the draft's next suffix. Without a draft pass the draft's rows follow their roots
        and the suffix grows (the draft catches up later); that choice of rows waits, composed over the
        iterations the draft idles, for its next pass or the answer's end (`settle_draft`). Returns the
        draft's next suffixes."""
        target.commit([AcceptedPath(h.root, tuple(n.tid for n in h.chain)) for h in nxt])
        if draft is None:
            return d_suffix
        if fed:
            paths = [AcceptedPath(h.root, tuple(n.did for n in h.chain if n.did is not None)) for h in nxt]
            draft.commit(paths)
            return [h.beam.tokens[len(live[h.root].tokens) + len(p.nodes):] for h, p in zip(nxt, paths)]
        held = range(len(live)) if self.draft_rows is None else self.draft_rows  # the draft's row under each beam
        self.draft_rows = [held[h.root] for h in nxt]
        return [tuple(d_suffix[h.root]) + h.beam.tokens[len(live[h.root].tokens):] for h in nxt]

    def settle_draft(self, draft: Context | None) -> None:
        """The draft's context takes the rows its idle iterations chose (one commit for all of them)."""
        if draft is not None and self.draft_rows is not None:
            draft.commit([AcceptedPath(r, ()) for r in self.draft_rows])
            self.draft_rows = None

    # -- statistics, the forest view, learning (outside the arithmetic) -------------------------------
    def account(self, target, draft, it: Iteration, output: list[Handle], nxt) -> None:
        """Once per iteration, from its record: the metrics, the forest view, and what the policy and the
        builder learn (the builder's index grows by every output beam, pruned ones too; every verified row
        calibrates its sources and feeds the recycled successors)."""
        m = self.metrics
        for l, o in enumerate(it.outcomes, start=1):
            self._layer_stats(l, o)
            self._layer_view(it, o)
            self._layer_lessons(l, o)
        m.iterations += 1
        m.steps.append(len(output[0].beam.tokens) - len(it.live[0].tokens))
        m.mark_first_token()
        m.carried.append(len(nxt))
        m.track_kv(target, draft)
        ws = it.draft_beams if it.gamma > 0 or not it.layers else 0  # W_S 0: lookup nodes only
        it.shape = (max(it.gamma, len(it.layers)), ws)
        m.forests.append(it.shape)
        if self.policy is not None:
            self.policy.settle(m.steps[-1])
        if self.builder is not None:
            self.builder.learn(it.verified_rows, [n.candidate for L in it.layers for n in L.lookups if n.candidate])
            built = max((l for l, L in enumerate(it.layers, start=1) if any(n.candidate for n in L.lookups)), default=0)
            self.builder.settle_chain(built, sum(1 for o in it.outcomes[:built] if o.passed))
            self.builder.extend([h.beam.tokens for h in output], len(it.live[0].tokens))

    def _layer_lessons(self, l: int, o: LayerOutcome) -> None:
        layer = o.layer
        if self.policy is not None and layer.drafts:
            self.policy.observe(l, len(layer.drafts), outcomes=[j in o.accepted for j in range(o.consumed)],
                                passed=o.passed, by_cache=o.passed and not o.by_drafts,
                                distinct=len({n.content for n in layer.drafts}),
                                lookups=sum(n.source == "draft" for n in layer.lookups))
        if self.builder is not None and not layer.drafts and any(n.candidate for n in layer.lookups):
            self.builder.settle_layer(l, o.passed)  # model-free nodes alone decided this layer

    def _layer_stats(self, l: int, o: LayerOutcome) -> None:
        st, layer, hit = self.metrics.layer(l), o.layer, o.hit
        st.attempted += 1
        st.passed += int(o.passed)
        st.passed_by_cache += int(o.passed and not o.by_drafts)
        invalid = sum(not d.valid for d in o.drafts[:o.consumed])
        st.accepted += len(o.accepted)
        st.auto_rejected += invalid
        st.tested += o.consumed - invalid
        st.untested += len(o.drafts) - o.consumed
        st.lookup_nodes += len(layer.lookups)
        st.cache_hits += len(hit)
        st.lookup_hits += sum(id(n) in hit for n in layer.lookups)
        for n in layer.lookups:
            self.metrics.lookup_source(n.source, hit=id(n) in hit)
        self.metrics.widths.append(o.width)

    def _layer_view(self, it: Iteration, o: LayerOutcome) -> None:
        accepted, consumed, hit = o.accepted, o.consumed, o.hit
        status = lambda j, n, d: ("accepted" if j in accepted else "hit" if id(n) in hit else
                                  "auto-rejected" if not d.valid else "rejected" if j < consumed else "untested")
        prev = {id(n): i for i, n in enumerate(it.view_layers[-1]["_nodes"])} if it.view_layers else {}
        up = lambda n: n.root if n.up is None else prev.get(id(n.up), -1)
        it.view_layers.append({
            "width": o.width, "passed": o.passed,
            "passed_by": ("acceptance" if o.by_drafts else "cache") if o.passed else None,
            "nodes": [{"parent": n.parent, "token": n.token, "status": status(j, n, d)}
                      for j, (n, d) in enumerate(zip(o.layer.drafts, o.drafts))],
            "lookups": [{"parent": up(n), "token": n.token, "source": n.source,
                         "status": "hit" if id(n) in hit else "lookup"} for n in o.layer.lookups],
            "corrections": [int(k % self.vocab) for (k, i), n in zip(o.outputs, o.nodes) if i is None and n is None],
            "_nodes": o.layer.nodes})

    def view(self, it: Iteration) -> dict:
        """The forest view of an accounted iteration (the UI's)."""
        layers = [{k: v for k, v in s.items() if k != "_nodes"} for s in it.view_layers]
        g, ws = it.shape
        return {"layers": layers, "gamma": g, "draft_beams": ws, "adaptive": self.policy is not None}


def _top_q_lookups(n: int, l: int, parent_content: list[int], prev, q,
                   drafts: list[Node]) -> list[tuple[int, int]]:
    """Lookup nodes: the layer's n most likely q_beam pairs whose content no draft holds."""
    if n <= 0 or q is None or not q.at_most(1):
        return []
    drafted = {(parent_content[d.parent], d.token) for d in drafts}
    out, seen = [], set()
    for key in q.top(n + len(drafts)):  # descending q, ties by lower key
        par, tok = int(key // q.vocab), int(key % q.vocab)
        c = (parent_content[par], tok)
        if c in seen or c in drafted or (prev is not None and prev[par].ended):
            continue
        seen.add(c)
        out.append((par, tok))
        if len(out) == n:
            break
    return out


def _policy(params: DecodeParams, costs, draft) -> ForestPolicy | None:
    """A forest policy priced by `costs` for an adaptive forest with a draft model (the engine passes its own)."""
    if not params.adaptive or draft is None:
        return None
    if costs is None or costs[1] is None:
        raise ConfigError("forest='adaptive' needs the timed pass costs of the target and the draft "
                          "(the engine provides them; direct decoder calls pass costs=(target_cost, draft_cost))")
    return ForestPolicy.for_params(params, *costs)


def model_free_sources(params: DecodeParams) -> list[str]:
    """The model-free lookup sources a request asks for ([] where it gets no model-free nodes: not DSBD, no
    such source, no lookup nodes or no depth)."""
    if not MODE_FACTS[params.mode].forest or params.lookup_nodes <= 0 or params.gamma <= 0:
        return []
    return [s for s in params.lookup_sources if s != "draft"]


def model_free_builder(params: DecodeParams, prompt, stopper: Stopper, vocab: int, target_cost=None,
                       calibration=None) -> Builder | None:
    """The model-free node builder of params.lookup_sources (None when they name none or lookup_nodes is 0):
    priced by the target's cost curve and the decoder's own costs for an adaptive forest, else the likeliest
    nodes up to the cap. `calibration`: what earlier answers learnt (lookups.Calibration)."""
    sources = model_free_sources(params)
    if not sources:
        return None
    price = target_cost if params.adaptive else None
    costs = {"verify_cost": lookup_layer_cost(params, vocab),
             "step_cost": decoder_costs(params, vocab)["step_cost"]} if price is not None else {}
    return Builder(prompt, sources=sources, target_cost=price, finished=stopper.finished, calibration=calibration,
                   **costs)


def _builder(params: DecodeParams, prompt, costs, stopper: Stopper, vocab: int) -> Builder | None:
    return model_free_builder(params, prompt, stopper, vocab, costs[0] if costs is not None else None)
