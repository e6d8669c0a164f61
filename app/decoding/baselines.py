"""Target-only decoders (greedy, sampling, beam search, beam sampling) and standard speculative sampling.

All of them use DSBD's backend call: a forest with empty trees (one suffix token per live row), and the
same joint warp (spec §2), so their distributions are directly comparable with DSBD's.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from app.config import MODE_FACTS, DecodeParams
from backends.base import ROOT, AcceptedPath, Context, Forest

from . import Step, rng_streams
from .beams import Beam, Pool, Stopper, common_prefix, final_choice
from .inputs import pad_vocab, warp_of
from .metrics import Metrics
from . import rowmath
from .sampling import Draft, Rand, SeededRand, Warp


def _beam_loop(*, target: Context, prompt: Sequence[int], params: DecodeParams, stopper: Stopper, metrics: Metrics,
               choose) -> Iterator[Step]:
    """Shared loop of the beam decoders: `choose(logits, scores, finishes) -> [(row, token, raw log-prob)]` picks
    the next pairs from the pass's logits (one row per live beam) and the beams' scores; `finishes(row, token)`
    tells whether that pair would end its beam."""
    width = MODE_FACTS[params.mode].rows(params.beams)
    target.prefill(prompt[:-1])
    metrics.mark_prefilled()
    live, suffix = [Beam((), 0.0)], [(prompt[-1],)]
    pool = Pool(width, params.length_penalty)
    while True:
        logits = target.evaluate(Forest(suffix=tuple(suffix)))
        metrics.target_passes += 1
        metrics.steps.append(1)
        metrics.iterations += 1
        metrics.track_kv(target)
        scores = np.array([b.score for b in live])
        picked = choose(logits.roots, scores, lambda r, x: stopper.finished(live[r].tokens + (x,)))
        nxt, rows = [], []
        for r, x, lp in picked:
            beam = Beam(live[r].tokens + (int(x),), float(scores[r] + lp), False)
            if stopper.finished(beam.tokens):
                pool.add(Beam(beam.tokens, beam.score, True))
            else:
                nxt.append(beam)
                rows.append(r)
        live = nxt
        metrics.mark_first_token()
        metrics.carried.append(len(live))
        out_of_budget = bool(live) and len(live[0].tokens) >= params.max_new_tokens
        if not live or out_of_budget or pool.is_done(live):
            best = final_choice(pool.beams, live, params.length_penalty)
            metrics.finish_reason = "stop" if best.finished else "length"
            yield Step(final=best.tokens, live=0, done=True, output=best)
            return
        target.commit([AcceptedPath(r) for r in rows])
        suffix = [(b.tokens[-1],) for b in live]
        yield Step(final=common_prefix([b.tokens for b in live + pool.beams]), live=len(live))


def _row_loop(*, target: Context, prompt: Sequence[int], params: DecodeParams, stopper: Stopper, metrics: Metrics,
              step) -> Iterator[Step]:
    """`_beam_loop` on one row (width 1: greedy, sample): `step(logits, score) -> (token, raw log-prob)` picks
    the next token from the pass's [1, V] logits. The beam loop's steps, stats and answer, with no pool, beam list
    or common prefix to keep: a token costs a few calls."""
    target.prefill(prompt[:-1])
    metrics.mark_prefilled()
    tokens, score, last = (), 0.0, prompt[-1]
    steps, carried, max_new = metrics.steps, metrics.carried, params.max_new_tokens
    while True:
        logits = target.evaluate(Forest(suffix=((last,),)))
        metrics.target_passes += 1
        steps.append(1)
        metrics.iterations += 1
        metrics.track_kv(target)
        last, lp = step(logits.roots, score)
        tokens += (last,)
        score = float(score + lp)
        finished = stopper.finished(tokens)
        metrics.mark_first_token()
        carried.append(0 if finished else 1)
        if finished or len(tokens) >= max_new:
            metrics.finish_reason = "stop" if finished else "length"
            yield Step(final=tokens, live=0, done=True, output=Beam(tokens, score, finished))
            return
        target.commit(_SAME_ROW)
        yield Step(final=tokens, live=1)


_SAME_ROW = (AcceptedPath(0),)  # a one-row loop's commit: the row with its suffix


def _one_row(rm, pick, *, warp: Warp | None = None, rand: Rand | None = None):
    """A `_row_loop` step: `pick(rows, scores) -> token` on the general row math (`rm.rows`, scores [1]), or the
    backend's fused plain step where it has one (`plain_step`: the same token and log-prob, bit for bit); rand
    None: greedy's argmax."""
    fused = getattr(rm, "plain_step", None)

    def step(logits, score: float) -> tuple[int, float]:
        if fused is not None:
            out = fused(logits, score, warp, rand)
            if out is not None:
                return out
        lp = rm.rows(logits)
        x = int(pick(lp, np.array([score])))
        return x, lp.at(0, x)

    return step


def greedy(*, target: Context, prompt: Sequence[int], params: DecodeParams, stopper: Stopper,
           metrics: Metrics) -> Iterator[Step]:
    """Argmax decoding (ties: lower token id)."""
    step = _one_row(rowmath.backend(), lambda lp, _: lp.argmax(0))
    return _row_loop(target=target, prompt=prompt, params=params, stopper=stopper, metrics=metrics, step=step)


def beam_search(*, target: Context, prompt: Sequence[int], params: DecodeParams, stopper: Stopper,
                metrics: Metrics) -> Iterator[Step]:
    """Baseline C: deterministic beam search over the 2W highest raw joint scores."""
    w = params.beams
    rm = rowmath.NumpyRows()

    def choose(logits, scores: np.ndarray, finishes) -> list[tuple[int, int, float]]:
        lp = rm.rows(logits)  # raw log-probs [rows, vocab]
        z = scores[:, None] + lp.lp  # joint log-scores [rows, vocab]
        flat = z.ravel()
        k = min(2 * w, flat.size)
        top = np.argpartition(-flat, k - 1)[:k]
        top = top[np.lexsort((top, -flat[top]))]  # descending score, ties by lower key
        picked, live = [], 0
        for rank, key in enumerate(top):
            r, x = divmod(int(key), z.shape[1])
            if finishes(r, x):
                if rank < w:  # a finishing pair enters the pool only among the first W walked
                    picked.append((r, x, lp.at(r, x)))
            elif live < w:
                picked.append((r, x, lp.at(r, x)))
                live += 1
        return picked

    return _beam_loop(target=target, prompt=prompt, params=params, stopper=stopper, metrics=metrics,
                      choose=choose)


def beam_sampling(*, target: Context, prompt: Sequence[int], params: DecodeParams, stopper: Stopper,
                  metrics: Metrics, rand: Rand | None = None, rm=None) -> Iterator[Step]:
    """Baselines A (with replacement) and B (without replacement: W sequential draws, each from p over the pairs
    not drawn yet); W = 1 is multinomial sampling. One uniform of the verify stream per draw, so DSBD's step
    without a forest is this step. `rand` replaces the seeded stream (tests enumerate every outcome); `rm` the
    row-math backend."""
    _, rng = rng_streams(params.seed)
    warp = warp_of(params)
    width = MODE_FACTS[params.mode].rows(params.beams)
    replace = params.mode != "beam-sample"
    draws = rand or SeededRand(rng)
    rm = rm or rowmath.backend()

    def keys(lp, scores: np.ndarray):
        p = rm.law(lp, scores, warp)
        return p, p.sample(width, draws) if replace else rm.distinct_keys(p, width, draws)

    if width == 1:  # one row: a draw from its law (with or without replacement alike)
        step = _one_row(rm, lambda lp, scores: keys(lp, scores)[1][0], warp=warp, rand=draws)
        return _row_loop(target=target, prompt=prompt, params=params, stopper=stopper, metrics=metrics, step=step)

    fused = getattr(rm, "beam_step", None)  # the backend's fused step (the same keys and log-probs, bit for bit)

    def choose(logits, scores: np.ndarray, _) -> list[tuple[int, int, float]]:
        if fused is not None:
            picked = fused(logits, scores, warp, draws, width, replace)
            if picked is not None:
                return picked
        lp = rm.rows(logits)
        p, drawn = keys(lp, scores)
        pairs = [divmod(int(k), p.vocab) for k in drawn]
        return [(r, x, lp.at(r, x)) for r, x in pairs]

    return _beam_loop(target=target, prompt=prompt, params=params, stopper=stopper, metrics=metrics,
                      choose=choose)


def speculative_sampling(*, target: Context, draft: Context, prompt: Sequence[int], params: DecodeParams,
                         stopper: Stopper, metrics: Metrics, vocab: int, rands: tuple[Rand, Rand] | None = None,
                         rm=None) -> Iterator[Step]:
    """Standard speculative sampling (Leviathan et al.; Chen et al.): a chain of gamma drafts, min(1, p/q)
    tests, a residual draw at the first rejection, a bonus token after a full pass. Each position is one
    layer of DSBD's verifier (`sampling.mss`) with one draft and width 1. `rands` = (draft's, verifier's) Rand
    replaces the seeded streams (tests enumerate every outcome)."""
    draft_rand, rand = rands or tuple(SeededRand(r) for r in rng_streams(params.seed))
    warp = warp_of(params)
    rm = rm or rowmath.backend()
    target.prefill(prompt[:-1])
    draft.prefill(prompt[:-1])
    metrics.mark_prefilled()
    tokens: list[int] = []
    drafted: list[bool] = []  # per token: an accepted draft token (else drawn by the target)
    score = 0.0
    t_suffix, d_suffix = (prompt[-1],), (prompt[-1],)
    while True:
        g = min(params.gamma, params.max_new_tokens - len(tokens) - 1)
        drafts, qs = _draft_chain(draft, d_suffix, g, tokens, warp, vocab, draft_rand, stopper, metrics, rm)
        rows = _score_chain(target, t_suffix, drafts, metrics, rm)  # the target's row after each chain prefix
        metrics.track_kv(target, draft)
        accepted, new = _verify_chain(rm, rows, drafts, qs, warp, rand, metrics)
        emitted = drafts[:accepted] + [new]
        metrics.steps.append(len(emitted))
        # EOS, stop strings and the budget end the chain at the first token that ends it.
        done = False
        for j, x in enumerate(emitted):
            tokens.append(x)
            drafted.append(j < accepted)
            score += rows[j][x]
            if stopper.finished(tokens) or len(tokens) >= params.max_new_tokens:
                done = True
                break
        metrics.mark_first_token()
        metrics.carried.append(1)
        if done:
            beam = Beam(tuple(tokens), score, stopper.finished(tokens), tuple(drafted))
            metrics.finish_reason = "stop" if beam.finished else "length"
            yield Step(final=beam.tokens, live=0, done=True, output=beam)
            return
        t_suffix, d_suffix = _commit_chain(target, draft, d_suffix, drafts, accepted, new)
        yield Step(final=tuple(tokens), live=1)


def _per_token(rm, row, warp: Warp):
    """The warped law of one row's next token (one parent: keys are token ids)."""
    return rm.law(rm.stack([row]), [0.0], warp)


def _draft_chain(draft: Context, d_suffix: tuple[int, ...], g: int, tokens: list[int], warp: Warp, vocab: int,
                 rand: Rand, stopper: Stopper, metrics: Metrics, rm) -> tuple[list[int], list]:
    """Draft a chain of up to g tokens (g draft passes; the last token is never fed) and the laws drawn from."""
    drafts, qs = [], []
    for i in range(g):
        if i == 0:
            dl = draft.evaluate(Forest(suffix=(d_suffix,))).roots[0]
        else:
            dl = draft.evaluate(Forest(tokens=(drafts[-1],), parents=(ROOT if i == 1 else i - 2,),
                                       rows=(0,))).nodes[0]
        metrics.draft_passes += 1
        q = rm.law(rm.rows(pad_vocab(dl, vocab)[None, :]), [0.0], warp)
        x = int(q.sample(1, rand)[0])
        drafts.append(x)
        qs.append(q)
        if stopper.finished(tokens + drafts):
            break  # nothing to draft after an end
    return drafts, qs


def _score_chain(target: Context, t_suffix: tuple[int, ...], drafts: list[int], metrics: Metrics, rm) -> list:
    """One target pass over the suffix and the chain: the target's log-prob row after each prefix."""
    out = target.evaluate(Forest(suffix=(t_suffix,), tokens=tuple(drafts),
                                 parents=(ROOT, *range(len(drafts) - 1))[: len(drafts)],
                                 rows=(0,) * len(drafts)))
    metrics.target_passes += 1
    metrics.iterations += 1
    nodes = rm.rows(out.nodes) if drafts else None
    return [rm.rows(out.roots).row(0)] + [nodes.row(i) for i in range(len(drafts))]


def _verify_chain(rm, rows: list, drafts: list[int], qs: list, warp: Warp, rand: Rand,
                  metrics: Metrics) -> tuple[int, int]:
    """min(1, p/q) tests along the chain: (drafts accepted, the token drawn after them): the residual
    norm(max(p - q, 0)) at the first rejection, else a bonus token from p."""
    for i, x in enumerate(drafts):
        p = _per_token(rm, rows[i], warp)
        chain = rm.chain(p, rm.on_rows(qs[i], [[0]], [1]), 1)
        st = metrics.layer(i + 1)
        st.attempted += 1
        st.tested += 1
        passed, out = rm.verify(chain, [Draft(x, float(qs[i].lookup([x])[0]), True)], 1, rand)
        if passed:
            st.accepted += 1
            st.passed += 1
            continue
        return i, int(out[0][0])
    return len(drafts), int(_per_token(rm, rows[len(drafts)], warp).sample(1, rand)[0])


def _commit_chain(target: Context, draft: Context, d_suffix: tuple[int, ...], drafts: list[int], accepted: int,
                  new: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Keep the accepted chain's KV in both caches; returns the next target and draft suffixes."""
    target.commit([AcceptedPath(0, tuple(range(accepted)))])
    fed = min(accepted, max(len(drafts) - 1, 0))  # the draft never fed its last token
    if drafts:
        draft.commit([AcceptedPath(0, tuple(range(fed)))])
        return (new,), tuple(drafts[fed:accepted]) + (new,)
    return (new,), d_suffix + (new,)
