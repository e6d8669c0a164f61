"""DSBD: dynamic-width speculative beam decoding (spec §3-§10), full and memory-reduced modes.

One iteration: 1. draft beam sampling (g draft passes, W_S i.i.d. pairs per layer)  2. ONE target pass
over the whole forest  3. verify layer by layer (multi-step speculative sampling over (beam, token)
pairs, width from the acceptance DP)  4. commit both caches along the output beams' paths  5. reduce
to one beam in memory mode and stream the final prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import numpy as np

from backends.base import ROOT, Context, Forest, Path

from ..config import ConfigError
from . import Step, rng_streams
from .baselines import pad_vocab, warp_of
from .beams import Beam, Pool, Stopper, common_prefix, final_choice
from .forest_policy import ForestPolicy
from .metrics import Metrics
from .sampling import Draft, Joint, SeededRand, log_softmax, residual_chain, sample_iid, verify_layer, warp_joint
from .width import choose_width


@dataclass(frozen=True)
class Handle:
    """A beam inside an iteration: its root row, accepted forest nodes (depth order), target log-probs."""

    root: int
    chain: tuple[int, ...]
    beam: Beam
    lp: np.ndarray | None  # [vocab] raw target log p(. | beam); None for an output-layer beam


@dataclass
class DraftLayer:
    q: Joint  # q_beam^(l) over (parent slot, token) keys
    parents: np.ndarray  # [W_S] parent index (root row at l = 1, layer-(l-1) slot after)
    tokens: np.ndarray  # [W_S]
    qvals: np.ndarray  # [W_S]
    roots: np.ndarray  # [W_S]
    finished: np.ndarray  # [W_S] bool: the drafted path ended (EOS / stop string)


def _draft(*, draft: Context, live: Sequence[Beam], suffix, g: int, ws: int, params, stopper: Stopper,
           vocab: int, rng: np.random.Generator, metrics: Metrics) -> list[DraftLayer]:
    """Draft beam sampling for up to g layers of ws drafts; fewer if every drafted path ended."""
    warp = warp_of(params)
    scores = np.array([b.score for b in live])
    dscore = scores - scores.max()  # seeded with target scores (spec §4.1), best = 0
    roots = np.arange(len(live))
    paths = [b.tokens for b in live]
    ended = np.zeros(len(live), bool)
    layers: list[DraftLayer] = []
    logits = draft.evaluate(Forest(suffix=tuple(suffix))).roots  # [n_in, V]
    metrics.draft_passes += 1
    for l in range(1, g + 1):
        lq = log_softmax(pad_vocab(logits, vocab))  # [parents, V] raw draft log-probs
        z = dscore[:, None] + lq
        z[ended] = -np.inf  # a drafted path that ended has no children
        q = warp_joint(z, warp)
        keys = sample_iid(q, ws, rng)  # i.i.d. with replacement (spec §4: exactness needs it)
        par, tok = keys // vocab, keys % vocab
        paths = [paths[p] + (int(t),) for p, t in zip(par, tok)]
        layer = DraftLayer(q=q, parents=par, tokens=tok, qvals=q.lookup(keys), roots=roots[par],
                           finished=np.array([stopper.finished(p) for p in paths]))
        layers.append(layer)
        dscore, roots, ended = dscore[par] + lq[par, tok], layer.roots, layer.finished
        if l == g or ended.all():
            break
        # Feed layer l so its logits give layer l+1; node ids continue across layers (slot + (l-1) W_S).
        base = (l - 1) * ws
        logits = draft.evaluate(Forest(
            tokens=tuple(int(t) for t in tok),
            parents=tuple(ROOT if l == 1 else int(base - ws + p) for p in par),
            rows=tuple(int(r) for r in layer.roots))).nodes
        metrics.draft_passes += 1
    return layers


def _target_forest(suffix, layers: list[DraftLayer], ws: int) -> Forest:
    tokens, parents, rows = [], [], []
    for l, layer in enumerate(layers, start=1):
        for p, t, r in zip(layer.parents, layer.tokens, layer.roots):
            tokens.append(int(t))
            parents.append(ROOT if l == 1 else int((l - 2) * ws + p))
            rows.append(int(r))
    return Forest(suffix=tuple(suffix), tokens=tuple(tokens), parents=tuple(parents), rows=tuple(rows))


def _extend(h: Handle, token: int, node: int | None, node_lp: np.ndarray | None, *,
            drafted: bool | None = None) -> Handle:
    """h + token; `node` (the forest node holding token) joins the chain of KV kept at commit."""
    beam = Beam(h.beam.tokens + (token,), h.beam.score + float(h.lp[token]),
                drafted=h.beam.drafted + (node is not None if drafted is None else drafted,))
    return Handle(h.root, h.chain + ((node,) if node is not None else ()), beam, node_lp)


def dsbd(*, target: Context, draft: Context, prompt: Sequence[int], params, stopper: Stopper,
         metrics: Metrics, vocab: int, costs=None, policy: ForestPolicy | None = None, **_) -> Iterator[Step]:
    """DSBD generator; `params.mode` is "dsbd" (full) or "dsbd-mem" (one beam between iterations).

    params.forest == "adaptive": a ForestPolicy picks gamma <= params.gamma and W <= W_S <= params.draft_beams
    before each iteration from `costs` = (target, draft) pass-cost curves (or an injected `policy`).
    """
    memory = params.mode == "dsbd-mem"
    w = params.beams
    policy = _forest_policy(params, costs, policy)
    metrics.forest_policy = params.forest
    warp, lam = warp_of(params), params.length_penalty
    rng_draft, rng_verify = rng_streams(params.seed)
    rand = SeededRand(rng_verify)
    n_extra = 1 if memory and params.select == "sample" else w

    target.prefill(prompt[:-1])
    draft.prefill(prompt[:-1])
    metrics.mark_prefilled()
    live = [Beam((), 0.0)]
    t_suffix, d_suffix = [(prompt[-1],)], [(prompt[-1],)]
    pool = Pool(w, lam)

    def finish(candidates: Sequence[Beam]) -> Step:
        best = final_choice(pool.beams, candidates, lam)
        metrics.finish_reason = "stop" if best.finished else "length"
        return Step(final=best.tokens, live=0, done=True, output=best)

    while True:
        metrics.iterations += 1
        g = min(params.gamma, params.max_new_tokens - len(live[0].tokens) - 1)
        ws = params.draft_beams
        if policy is not None:  # from the past only (earlier layers' counts): the output law is unchanged
            g, ws = policy.choose(max_gamma=g, roots=sum(map(len, t_suffix)), draft_roots=sum(map(len, d_suffix)))
        metrics.forests.append((g, ws))
        # 1. draft
        layers = _draft(draft=draft, live=live, suffix=d_suffix, g=g, ws=ws, params=params, stopper=stopper,
                        vocab=vocab, rng=rng_draft, metrics=metrics) if g > 0 else []
        g = len(layers)
        # 2. one target pass over every root suffix and every draft node
        out = target.evaluate(_target_forest(t_suffix, layers, ws))
        metrics.target_passes += 1
        metrics.track_kv(target, draft)
        root_lp = log_softmax(out.roots)  # [n_in, V]
        node_lp = _LazyRows(out.nodes)  # [g * W_S, V], log-softmaxed only for the nodes a layer accepts
        # 3. verify layer by layer
        parents = [Handle(r, (), b, root_lp[r]) for r, b in enumerate(live)]  # index = parent key space
        valid = np.ones(len(parents), bool)
        output: list[Handle] | None = None
        stop_now = False
        snapshot = []
        for l, layer in enumerate(layers, start=1):
            p = _p_beam(parents, valid, warp, vocab)
            S, R, alpha = residual_chain(p, layer.q, ws)
            width = choose_width(alpha, params.threshold, params.min_beams, w)
            drafts = [Draft(key=int(pa * vocab + t), qval=float(qv), valid=bool(valid[pa]))
                      for pa, t, qv in zip(layer.parents, layer.tokens, layer.qvals)]
            passed, picked = verify_layer(drafts, S, R, width, rand)
            used = _count(metrics, l, drafts, picked, passed, width)
            if policy is not None:
                accepted = {i for _, i in picked if i is not None}
                policy.observe(l, ws, outcomes=[i in accepted for i in range(used)], passed=passed)
            snapshot.append(_layer_view(layer, drafts, picked, passed, width, vocab))
            base = (l - 1) * ws
            beams = [_extend(parents[k // vocab], k % vocab,
                             None if i is None else base + i,
                             None if i is None else node_lp[base + i]) for k, i in picked]
            if not passed:
                # Failed layer = output layer (exactly W_L beams). Its tokens, drafted or not, are the next
                # uncached suffix x_o (spec §8): an accepted draft's node must not join the committed chain,
                # or the target would see x_o twice (bigram toy models cannot tell; real models can).
                output = [_extend(parents[k // vocab], k % vocab, None, None, drafted=i is not None)
                          for k, i in picked]
                break
            ended = [stopper.finished(h.beam.tokens) for h in beams]
            if not memory:
                for h, e in zip(beams, ended):
                    if e:
                        pool.add(replace(h.beam, finished=True))
            still = [h for h, e in zip(beams, ended) if not e]
            if not still:  # a passed layer that leaves no live beam becomes the output layer
                output = beams
                break
            if not memory and pool.is_done([h.beam for h in still]):
                stop_now, output = True, still
                break
            # accepted, unfinished nodes parent the next layer; keyed by their draft slot
            parents = [None] * ws
            valid = np.zeros(ws, bool)
            for (_, i), h, e in zip(picked, beams, ended):
                if not e:
                    parents[i], valid[i] = h, True
        else:  # every layer passed: the extra layer from the last layer's logits
            p = _p_beam(parents, valid, warp, vocab)
            keys = sample_iid(p, n_extra, rng_verify)
            output = [_extend(parents[k // vocab], int(k % vocab), None, None) for k in keys]
        metrics.steps.append(len(output[0].beam.tokens) - len(live[0].tokens))
        metrics.mark_first_token()

        if stop_now:
            yield finish([h.beam for h in output])
            return
        # 5. retire finished beams; memory mode carries one
        ended = [stopper.finished(h.beam.tokens) for h in output]
        if memory:
            if params.select == "sample":
                keep = 0  # slot 1: an exact p_beam draw (spec §9)
            else:  # best: highest s; ties lowest slot
                keep = max(range(len(output)), key=lambda i: (output[i].beam.score, -i))
            carried = output[keep]
            if ended[keep]:
                yield finish([replace(carried.beam, finished=True)])
                return
            nxt = [carried]
        else:
            for h, e in zip(output, ended):
                if e:
                    pool.add(replace(h.beam, finished=True))
            nxt = [h for h, e in zip(output, ended) if not e]
        live = [h.beam for h in nxt]
        metrics.carried.append(len(live))
        if not live or len(live[0].tokens) >= params.max_new_tokens or pool.is_done(live):
            yield finish(live)
            return
        # 4. commit: keep the KV of every output beam's accepted path, in both caches
        target.commit([Path(h.root, h.chain) for h in nxt])
        t_suffix = [(b.tokens[-1],) for b in live]
        if g > 0:
            fed = g - 1  # layer-g tokens were never fed to the draft
            draft.commit([Path(h.root, h.chain[:fed]) for h in nxt])
            d_suffix = [tuple(b.tokens[len(b.tokens) - 1 - len(h.chain[fed:]):]) for h, b in zip(nxt, live)]
        else:  # no draft pass: the draft catches up next time it drafts, from its root rows' committed KV
            if policy is not None:  # rows follow their roots (a fixed gamma = 0 never drafts: nothing to keep)
                draft.commit([Path(h.root, ()) for h in nxt])
            d_suffix = [tuple(d_suffix[h.root]) + (b.tokens[-1],) for h, b in zip(nxt, live)]
        final = live[0].tokens if memory else common_prefix([b.tokens for b in live + pool.beams])
        yield Step(final=final, live=len(live), forest={"layers": snapshot, "gamma": g, "draft_beams": ws,
                                                        "adaptive": policy is not None})


class _LazyRows:
    """Row-wise log_softmax on demand: only accepted nodes need their target log-probs (issue 13, item 5).
    A row gives bit-for-bit the values of log_softmax over the whole [n, V] block."""

    def __init__(self, logits: np.ndarray) -> None:
        self.logits, self.rows = logits, {}

    def __getitem__(self, i: int) -> np.ndarray:
        row = self.rows.get(i)
        if row is None:
            row = self.rows[i] = log_softmax(self.logits[i])  # [V]
        return row


def _p_beam(parents: Sequence[Handle | None], valid: np.ndarray, warp, vocab: int) -> Joint:
    """p_beam over valid parents x V: joint raw target log-scores, warped (spec §2.1)."""
    z = np.full((len(parents), vocab), -np.inf)  # [parents, V]
    for i, h in enumerate(parents):
        if valid[i]:
            z[i] = h.beam.score + h.lp
    return warp_joint(z, warp)


def _count(metrics: Metrics, depth: int, drafts, picked, passed: bool, width: int) -> int:
    """Record one verified layer; returns how many drafts it consumed (tested or auto-rejected)."""
    st = metrics.layer(depth)
    st.attempted += 1
    st.passed += int(passed)
    accepted = [i for _, i in picked if i is not None]
    consumed = (max(accepted) + 1) if passed else len(drafts)
    invalid = sum(not d.valid for d in drafts[:consumed])
    st.accepted += len(accepted)
    st.auto_rejected += invalid
    st.tested += consumed - invalid
    st.untested += len(drafts) - consumed
    metrics.widths.append(width)
    return consumed


def _layer_view(layer: DraftLayer, drafts, picked, passed: bool, width: int, vocab: int) -> dict:
    """A small picture of one forest layer for the UI: nodes and their fate."""
    accepted = {i for _, i in picked if i is not None}
    return {
        "width": width,
        "passed": passed,
        "nodes": [{"parent": int(d.key // vocab), "token": int(d.key % vocab),
                   "status": "accepted" if i in accepted else ("auto-rejected" if not d.valid else "rejected")}
                  for i, d in enumerate(drafts)],
        "corrections": [int(k % vocab) for k, i in picked if i is None],
    }


def _forest_policy(params, costs, policy: ForestPolicy | None) -> ForestPolicy | None:
    """None for fixed forests; else the injected policy, or one over params' candidates priced by `costs`."""
    if getattr(params, "forest", "fixed") != "adaptive":
        return None
    if policy is not None:
        return policy
    if costs is None or costs[1] is None:
        raise ConfigError("forest='adaptive' needs the timed pass costs of the target and the draft "
                          "(the engine provides them; direct decoder calls pass costs=(target_cost, draft_cost))")
    return ForestPolicy.for_params(params, *costs)
