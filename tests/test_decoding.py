"""Process-level tests of every decoder on explicit bigram-table models (spec §13 items 7 and 9).

The laws of fixed-width DSBD (beam sampling with replacement), of the W = W_S = 1 reduction (sampling), with a
fixed forest and with an adaptive one whose choices vary with the past, and of speculative sampling are enumerated
exactly (every outcome of every draw, tests/law_helpers.py). Statistical design of the rest: chi-square
homogeneity of the returned sequences between two arms, cells with an expected count < 5 merged, significance 1e-4
per assertion, fixed seeds (deterministic in CI). The default suite runs sps at N = 4,000 per arm (detects a
total-variation gap of about 0.06 over <= 30 cells); the `slow` set runs every arm, at the spec's N = 2*10^5 where
no exact test holds its law and at 4*10^4 where one does; the reductions' arms at 2*10^5, which the exact tests
hold, are `heavy` (not in CI: 17 minutes on 2 cores).
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import pytest

from app.config import MODE_FACTS, DecodeParams
from app.decoding import decoder, start
from app.decoding.beams import Stopper, common_prefix
from app.decoding.metrics import Metrics
import law_helpers
from dsbd_helpers import enumerate_paths, homogeneous
from refmodel import TableModel, bigram
from toy_models import DRAFT, TARGET, V, VARYING

ALPHA = 1e-4


def run(mode: str, target, draft=None, *, seed: int, prompt=(1, 2), collect_steps=False, costs=None, **kw):
    """One generation; `costs` = (target, draft) pass-cost curves for forest="adaptive" (tests/test_forest_policy)."""
    params = DecodeParams(mode=mode, seed=seed, **kw).validated()
    rows = params.beams
    t = target.context(rows=rows, max_tokens=256)
    d = draft.context(rows=rows, max_tokens=256) if draft is not None else None
    stopper = Stopper(eos_ids=frozenset({0}), stop=params.stop, decode=target.tokenizer.decode)
    metrics = Metrics(mode=mode)
    steps = list(start(params, target=t, draft=d, prompt=list(prompt), stopper=stopper, metrics=metrics,
                       vocab=target.vocab, costs=costs))
    assert steps[-1].done
    out = steps[-1].output.tokens
    return (out, metrics, steps, t) if collect_steps else out


_ARMS: dict = {}  # the baselines' arms, shared by the tests that compare against the same one


def sample_arm(mode, target, draft, n, base_seed, *, forest: str = "fixed", **kw) -> Counter:
    """n answers; forest="adaptive" prices forests with VARYING and asserts the choice varied with the past."""
    if draft is None and forest == "fixed":
        key = (mode, id(target), n, base_seed, tuple(sorted(kw.items())))
        if key not in _ARMS:
            _ARMS[key] = Counter(run(mode, target, seed=base_seed + i, **kw) for i in range(n))
        return Counter(_ARMS[key])
    if forest == "fixed":
        return Counter(run(mode, target, draft, seed=base_seed + i, **kw) for i in range(n))
    out, by_cap = Counter(), {}
    for i in range(n):
        tokens, m, _, _ = run(mode, target, draft, seed=base_seed + i, collect_steps=True, forest=forest,
                              costs=VARYING, **kw)
        out[tokens] += 1
        done = 0
        for (g, ws), steps in zip(m.forests, m.steps):  # (gamma, W_S) chosen vs the budget's cap on gamma
            by_cap.setdefault(min(kw.get("gamma", 3), kw["max_new_tokens"] - done - 1), set()).add((g, ws))
            done += steps
    assert any(len(chosen) > 1 for chosen in by_cap.values()), by_cap  # not a function of the budget alone
    return out


# --- reductions (spec §11 R1-R3) -----------------------------------------------------------------

def test_each_decoder_declares_what_start_passes_it():
    """start() gives a decoder the common arguments, a drafting mode's the draft (None without a draft model) and
    vocab, a forest mode's the costs, policy and model-free node builder: each decoder names every one it gets
    and requires no other."""
    import inspect

    for mode, facts in MODE_FACTS.items():
        if not facts.concrete:
            continue
        declared = inspect.signature(decoder(mode)).parameters
        passed = {"target", "prompt", "params", "stopper", "metrics"} | \
            ({"draft", "vocab"} if facts.uses_draft else set()) | \
            ({"costs", "policy", "nodes"} if facts.forest else set())
        assert passed <= set(declared), (mode, sorted(passed - set(declared)))
        required = {n for n, p in declared.items() if p.default is p.empty and p.kind is not p.VAR_KEYWORD}
        assert required <= passed, (mode, sorted(required - passed))
    with pytest.raises(ValueError, match="sizes no forest"):
        start(DecodeParams(mode="greedy").validated(), target=None, draft=None, prompt=[1], stopper=None,
              metrics=None, vocab=V, costs=VARYING)


@pytest.mark.parametrize("seed", range(5))
def test_gamma_zero_is_beam_sampling_with_replacement_token_for_token(seed):
    kw = dict(beams=3, max_new_tokens=6, temperature=1.0)
    a = run("dsbd", TARGET, DRAFT, seed=seed, gamma=0, draft_beams=4, **kw)
    b = run("beam-sample-repl", TARGET, seed=seed, **kw)
    assert a == b


def exact_arm(mode: str, **kw) -> tuple[dict, dict]:
    """The exact law of the returned sequence on law_helpers' pair (every outcome enumerated) and the forests an
    adaptive policy (priced by VARYING) chose, by the budget's cap on gamma."""
    p = law_helpers.params(mode, **kw)
    law, by_cap = defaultdict(float), {}

    def one(rand):
        m = Metrics(mode=mode)
        return law_helpers.generate(p, rand, metrics=m, costs=VARYING if p.adaptive else None), m

    for (tokens, m), pr in enumerate_paths(one):
        law[tokens] += pr
        done = 0
        for (g, ws), steps in zip(m.forests, m.steps):
            by_cap.setdefault(min(p.gamma, p.max_new_tokens - done - 1), set()).add((g, ws))
            done += steps
    if p.adaptive:  # not a function of the budget alone
        assert any(len(chosen) > 1 for chosen in by_cap.values()), by_cap
    return law, by_cap


def max_gap(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


@pytest.mark.parametrize("forest", ["fixed", "adaptive"])
def test_speculative_reduction_has_the_sampling_law_exactly(forest):
    """R1: dsbd-mem with W = W_S = W_min = 1, carrying its sampled beam, is multinomial sampling."""
    one = dict(beams=1, min_beams=1, max_new_tokens=5)
    want, _ = exact_arm("sample", **one)
    got, _ = exact_arm("dsbd-mem", draft_beams=1, select="sample", forest=forest, **one)
    assert max_gap(got, want) < law_helpers.EXACT


def test_speculative_sampling_has_the_sampling_law_exactly():
    """R1 for standard speculative sampling: chains of gamma = 2 drafts, four answer tokens (a full pass, a
    rejection, a bonus token, the budget's shorter last chain), every outcome enumerated, is multinomial
    sampling's law."""
    want, _ = exact_arm("sample", beams=1, min_beams=1, max_new_tokens=4)
    got, _ = exact_arm("sps", beams=1, min_beams=1, gamma=2, max_new_tokens=4)
    assert abs(sum(got.values()) - 1) < law_helpers.EXACT and len(want) > 20
    assert max_gap(got, want) < law_helpers.EXACT


@pytest.mark.parametrize("fixed,forest", [(dict(min_beams=2), "fixed"), (dict(min_beams=1, threshold=0.0), "fixed"),
                                          (dict(min_beams=2), "adaptive")], ids=["W_min=W", "t=0", "adaptive"])
def test_fixed_width_dsbd_has_the_beam_sampling_law_exactly(fixed, forest):
    """W = 2, W_S = 2: two answer tokens under a fixed forest of depth 2; three under an adaptive one of depth up
    to 1, so that its second iteration may choose either depth (t = 0 adaptive: the slow chi-square below)."""
    shape = dict(max_new_tokens=2) if forest == "fixed" else dict(gamma=1, max_new_tokens=3)
    want, _ = exact_arm("beam-sample-repl", max_new_tokens=shape["max_new_tokens"])
    got, _ = exact_arm("dsbd", forest=forest, **fixed, **shape)
    assert max_gap(got, want) < law_helpers.EXACT


SLOW = pytest.mark.slow
HEAVY = pytest.mark.heavy  # longer than CI can hold; the exact tests above hold each arm's law


# N = 2*10^5 where no exact test holds the arm's law; 4*10^4 where one does (the tests above), to keep the slow
# set within CI's time.
@pytest.mark.parametrize("n,forest", [(4000, "fixed"), pytest.param(200_000, "fixed", marks=[SLOW, HEAVY]),
                                      pytest.param(40_000, "adaptive", marks=SLOW)])
def test_speculative_reductions_match_target_sampling(n, forest):
    kw = dict(max_new_tokens=4, gamma=2)
    ref = sample_arm("sample", TARGET, None, n, 10_000_000, max_new_tokens=4)
    mem = sample_arm("dsbd-mem", TARGET, DRAFT, n, 30_000_000, beams=1, draft_beams=1, min_beams=1,
                     select="sample", forest=forest, **kw)
    assert homogeneous(ref, mem) > ALPHA
    if forest == "fixed":  # sps has no forest policy
        sps = sample_arm("sps", TARGET, DRAFT, n, 20_000_000, **kw)
        assert homogeneous(ref, sps) > ALPHA


@SLOW
@pytest.mark.parametrize("forest", ["fixed", "adaptive"])
@pytest.mark.parametrize("fixed", [dict(min_beams=2), dict(threshold=0.0)], ids=["W_min=W", "t=0"])
def test_fixed_width_dsbd_matches_beam_sampling_with_replacement(fixed, forest):
    """The exact tests above on a larger forest (gamma 2, four answer tokens): the spec's N = 2*10^5 for t = 0
    with an adaptive forest, which no exact test holds; 4*10^4 for the others."""
    n = 200_000 if (forest, fixed.get("threshold")) == ("adaptive", 0.0) else 40_000
    kw = dict(beams=2, max_new_tokens=4)
    ref = sample_arm("beam-sample-repl", TARGET, None, n, 40_000_000, **kw)
    got = sample_arm("dsbd", TARGET, DRAFT, n, 50_000_000, draft_beams=3, gamma=2, forest=forest, **fixed, **kw)
    assert homogeneous(ref, got) > ALPHA


def test_negative_control_biased_draft_sampling_is_detected():
    """The homogeneity check has teeth: sampling at another temperature must be told apart."""
    ref = sample_arm("sample", TARGET, None, 4000, 60_000_000, max_new_tokens=4)
    hot = sample_arm("sample", TARGET, None, 4000, 70_000_000, max_new_tokens=4, temperature=1.3)
    assert homogeneous(ref, hot) < 1e-10


# --- draft == target ----------------------------------------------------------------------------

def test_identical_draft_accepts_every_draft():
    _, m, _, _ = run("sps", TARGET, TARGET, seed=3, max_new_tokens=30, gamma=3, collect_steps=True)
    assert all(s.accepted == s.tested for s in m.layers.values())
    _, m, _, _ = run("dsbd", TARGET, TARGET, seed=3, beams=3, draft_beams=3, max_new_tokens=30,
                     threshold=0.5, collect_steps=True)
    tested = sum(s.tested for s in m.layers.values())
    assert tested > 0 and all(s.accepted == s.tested for s in m.layers.values())


@pytest.mark.parametrize("mode,kw", [
    ("sps", dict(top_k=1, gamma=3)),
    ("dsbd", dict(top_k=1, beams=1, draft_beams=2, gamma=3)),
    ("dsbd-mem", dict(top_k=1, beams=2, draft_beams=3, gamma=2)),
    ("beam", dict(beams=1)),
])
def test_greedy_equivalent_settings_reproduce_greedy(mode, kw):
    # No EOS mass: beam search with W = 1 then walks exactly the greedy path.
    model = TableModel(lambda seq: np.sin(np.arange(7) * (1 + sum(seq) % 5) + len(seq)) - 50 * np.eye(7)[0], 7)
    greedy = run("greedy", model, seed=0, max_new_tokens=12)
    assert run(mode, model, bigram(7, 5), seed=1, max_new_tokens=12, **kw) == greedy


# --- termination and streaming (spec §13.9) ------------------------------------------------------

@pytest.mark.parametrize("mode", ["sample", "beam", "beam-sample", "beam-sample-repl", "sps", "dsbd", "dsbd-mem"])
def test_streamed_prefix_grows_and_prefixes_output_within_budget(mode):
    for seed in range(40):
        out, m, steps, _ = run(mode, TARGET, DRAFT, seed=seed, beams=3, max_new_tokens=7, gamma=3,
                               collect_steps=True)
        assert len(out) <= 7
        prev = ()
        for s in steps:
            assert s.final[: len(prev)] == prev, "the streamed prefix shrank"
            prev = s.final
        assert out[: len(prev)] == prev
        assert 0 not in out[:-1], "EOS only as the last token"



@pytest.mark.parametrize("backend", ["compiled", "torch", "numpy"])
@pytest.mark.parametrize("mode,kw", [
    ("greedy", {}), ("sample", {}), ("sample", dict(temperature=0.6)), ("sample", dict(top_k=2)),
    ("sample", dict(top_p=0.8)), ("beam-sample", dict(beams=1)), ("beam-sample-repl", dict(beams=1)),
    ("sample", dict(stop=("da",))),
], ids=str)
def test_the_one_row_loop_is_the_beam_loop_at_width_one(mode, kw, backend, monkeypatch):
    """The plain modes at width 1 run a loop of their own (no beam list, pool or common prefix; the compiled
    backend's fused step): every step it yields, the answer, its score and the metrics are the beam loop's at width
    1 with the general row math, the same uniforms drawn in the same order; with EOS, stop strings and the budget."""
    if backend == "compiled":
        pytest.importorskip("numba", reason="the compiled kernels need numba")
    from app.decoding import baselines, rowmath, rng_streams
    from app.decoding.inputs import warp_of
    from app.decoding.sampling import SeededRand

    rm = rowmath.make(backend)
    monkeypatch.setattr(rowmath, "_DEFAULT", [rm])
    model = TableModel(lambda seq: np.eye(5)[[1, 2, 3, 4, 1][seq[-1]]] * 1.5 + np.sin(np.arange(5) * len(seq)), 5)
    for seed in range(12):
        params = DecodeParams(mode=mode, seed=seed, max_new_tokens=3 + seed, **kw).validated()

        def go(decode):
            t = model.context(rows=1, max_tokens=64)
            stopper = Stopper(eos_ids=frozenset({0}), stop=params.stop, decode=model.tokenizer.decode)
            metrics = Metrics(mode=mode)
            steps = [(s.final, s.live, s.done, s.output) for s in decode(t, stopper, metrics)]
            return steps, {k: v for k, v in metrics.as_dict().items() if not k.endswith("_s")}

        got = go(lambda t, stopper, metrics: start(params, target=t, draft=None, prompt=[1, 2], stopper=stopper,
                                                   metrics=metrics, vocab=5))
        draws = SeededRand(rng_streams(seed)[1])
        warp = warp_of(params)

        def choose(logits, scores, _):  # the general row math
            lp = rm.rows(logits)
            if mode == "greedy":
                return [(0, lp.argmax(0), lp.at(0, lp.argmax(0)))]
            p = rm.law(lp, scores, warp)
            keys = rm.distinct_keys(p, 1, draws) if mode == "beam-sample" else p.sample(1, draws)
            return [(r, x, lp.at(r, x)) for r, x in (divmod(int(k), p.vocab) for k in keys)]

        want = go(lambda t, stopper, metrics: baselines._beam_loop(
            target=t, prompt=[1, 2], params=params, stopper=stopper, metrics=metrics, choose=choose))
        assert got == want, seed
        assert got[0][-1][3].finished == (got[1]["finish_reason"] == "stop")


@pytest.mark.parametrize("kw", [dict(replacement="without"), dict(replacement="with", min_beams=1),
                                dict(mode="dsbd-mem", replacement="with", min_beams=1)], ids=str)
def test_dsbd_s_plain_step_on_the_fused_step_is_the_general_one(kw, monkeypatch):
    """DSBD's plain step (the extra layer after every layer passed, a layer of lookup nodes only) takes the
    compiled backend's fused step: every step yielded, the answer and the metrics are those with the fused step
    turned off, seeded, with lookup layers that pass and that fail (prompt lookup on a cycling model)."""
    pytest.importorskip("numba", reason="the compiled kernels need numba")
    from app.decoding import rowmath
    from app.decoding.rowmath.compiled import CompiledRows

    monkeypatch.setattr(rowmath, "_DEFAULT", [rowmath.make("compiled")])
    model = TableModel(lambda seq: np.eye(5)[[1, 2, 3, 4, 1][seq[-1]]] * 2.5 + np.sin(np.arange(5) * len(seq)), 5)
    settings = dict(mode="dsbd", beams=2, min_beams=2, forest="fixed", gamma=3, lookup_nodes=2,
                    lookup_sources=("match",)) | kw
    runs: dict = {}
    for arm in ("fused", "general"):
        with monkeypatch.context() as m:
            if arm == "general":
                m.setattr(CompiledRows, "beam_step", lambda self, *a: None)
            for seed in range(8):
                params = DecodeParams(seed=seed, max_new_tokens=24, **settings).validated()
                t = model.context(rows=8, max_tokens=128)
                stopper = Stopper(eos_ids=frozenset({0}), decode=model.tokenizer.decode)
                metrics = Metrics(mode=params.mode)
                steps = [(s.final, s.live, s.done, s.output) for s in
                         start(params, target=t, draft=None, prompt=[1, 2, 3, 4, 1, 2], stopper=stopper,
                               metrics=metrics, vocab=5)]
                runs.setdefault(seed, {})[arm] = (steps, {k: v for k, v in metrics.as_dict().items()
                                                          if not k.endswith("_s")})
    for seed, arms in runs.items():
        assert arms["fused"] == arms["general"], seed
    layers = [a["fused"][1]["acceptance_by_depth"].get(1, {}) for a in runs.values()]
    assert sum(d.get("passed", 0) for d in layers) and sum(d.get("attempted", 0) - d.get("passed", 0)
                                                            for d in layers)


def test_stop_string_ends_beam_and_text_is_cut():
    model = TableModel(lambda seq: np.eye(5)[[1, 2, 3, 4, 1][seq[-1]]] * 30, 5)  # a -> b -> c -> d -> a
    out = run("greedy", model, seed=0, prompt=(1,), max_new_tokens=20, stop=("da",))
    st = Stopper(eos_ids=frozenset({0}), stop=("da",), decode=model.tokenizer.decode)
    assert model.tokenizer.decode(out) == b"bcda"
    assert st.visible_text(out, final=True) == "bc"
    assert st.visible_text(out[:3], final=False) == "bc", "a possible stop-string start is held back"


def test_streamed_text_decodes_only_new_tokens_and_equals_a_fresh_decode():
    """The stopper decodes each streamed prefix's new tokens only; the text equals decoding it afresh, also when
    a prefix does not extend the last one (a new stream) or ends inside a UTF-8 character."""
    pieces = {1: "é".encode()[:1], 2: "é".encode()[1:], 3: b"a", 4: b" b"}
    calls = []

    def decode(ids):
        calls.append(len(ids))
        return b"".join(pieces[i] for i in ids)

    st = Stopper(eos_ids=frozenset({0}), decode=decode)
    fresh = lambda ids, final: Stopper(eos_ids=frozenset({0}), decode=decode).visible_text(ids, final=final)
    stream = [3, 1, 2, 4, 3, 1, 2, 2, 0]
    for n in range(1, len(stream) + 1):
        assert st.visible_text(stream[:n], final=n == len(stream)) == fresh(stream[:n], n == len(stream))
    calls.clear()
    st.visible_text(stream[:5], final=False)
    st.visible_text(stream[:6], final=False)
    assert calls == [5, 1], "an extended prefix decodes its new token only"
    assert st.visible_text([4, 3], final=True) == " ba"  # another stream: decoded afresh


def test_the_streamed_prefix_is_the_longest_common_prefix():
    """The tokens every returnable sequence holds, position by position, for beams that split anywhere (inside
    and across the blocks the comparison takes), sequences of any length, one sequence and none."""
    def by_position(seqs):
        n = min(len(s) for s in seqs)
        return next((tuple(seqs[0][:i]) for i in range(n) if any(s[i] != seqs[0][i] for s in seqs)),
                    tuple(seqs[0][:n]))

    rng = np.random.default_rng(5)
    for _ in range(3000):
        base = tuple(int(t) for t in rng.integers(0, 3, rng.integers(0, 700)))
        seqs = [base[:rng.integers(0, len(base) + 1)] + tuple(int(t) for t in rng.integers(0, 3, rng.integers(0, 20)))
                for _ in range(rng.integers(1, 6))]
        assert common_prefix(seqs) == by_position(seqs)
    assert common_prefix([]) == () and common_prefix([[4, 5]]) == (4, 5)


@pytest.mark.parametrize("mode", ["sps", "dsbd", "dsbd-mem"])
def test_output_marks_the_tokens_the_draft_wrote(mode):
    for seed in range(20):
        out, m, steps, _ = run(mode, TARGET, DRAFT, seed=seed, beams=2, max_new_tokens=12, collect_steps=True)
        drafted = steps[-1].output.drafted
        assert len(drafted) == len(out)
        assert sum(drafted) <= sum(s.accepted for s in m.layers.values())  # only accepted drafts count
        assert len(out) - sum(drafted) <= m.iterations  # each iteration draws one token from the target
    # A draft identical to the target is always accepted: gamma drafts, then the target's bonus token.
    out, _, steps, _ = run("sps", TARGET, TARGET, seed=1, gamma=3, max_new_tokens=12, collect_steps=True)
    assert steps[-1].output.drafted == tuple(i % 4 != 3 for i in range(len(out)))
    plain = run("beam-sample", TARGET, seed=1, beams=2, max_new_tokens=12, collect_steps=True)[2][-1].output
    assert plain.drafted == ()  # no draft involved


def test_origin_runs_cover_the_visible_text_and_keep_split_characters_whole():
    pieces = {1: b"a", 2: b"\xc3", 3: b"\xa9", 4: b"!", 5: b"b"}  # tokens 2 + 3 are one character, e-acute
    decode = lambda ids: b"".join(pieces[i] for i in ids)  # noqa: E731
    st = Stopper(eos_ids=frozenset({0}), decode=decode)
    assert st.runs([1, 2, 3, 4, 0], [True, True, False, False, False]) == [("a", True), ("\u00e9!", False)]
    cut = Stopper(eos_ids=frozenset({0}), stop=("!",), decode=decode)
    assert cut.runs([5, 1, 4, 5], [False, True, True, False]) == [("b", False), ("a", True)]  # cut at "!"
    # SentencePiece-style: a lone piece loses its leading space, so runs come from decoded prefixes instead.
    spm = Stopper(eos_ids=frozenset({0}), decode=lambda ids: b"".join(b" " + pieces[i] for i in ids)[1:])
    assert spm.runs([1, 5, 5, 1], [True, False, False, True]) == [("a", True), (" b b", False), (" a", True)]


def test_memory_mode_carries_one_row_and_full_mode_up_to_w():
    _, _, _, ctx = run("dsbd-mem", TARGET, DRAFT, seed=2, beams=3, max_new_tokens=20, collect_steps=True)
    assert ctx.rows == 1
    _, m, _, _ = run("dsbd", TARGET, DRAFT, seed=2, beams=3, max_new_tokens=20, collect_steps=True)
    assert max(m.carried) <= 3


def test_eos_accepted_mid_iteration_retires_and_children_are_auto_rejected():
    # Target and draft both put most mass on EOS after token 3: drafts beneath an accepted EOS
    # node must be auto-rejected (their parent left the valid set), yet every output stays valid.
    def fn(seq):
        logits = np.zeros(4)
        logits[0] = 3.0 if seq[-1] == 3 else -1.0
        return logits

    model = TableModel(fn, 4)
    auto = 0
    for seed in range(30):
        out, m, _, _ = run("dsbd", model, model, seed=seed, beams=3, draft_beams=4, max_new_tokens=12,
                           threshold=0.3, collect_steps=True)
        assert 0 not in out[:-1]
        auto += sum(s.auto_rejected for s in m.layers.values())
    assert auto > 0


def test_metrics_are_consistent():
    out, m, _, _ = run("dsbd", TARGET, DRAFT, seed=4, beams=2, max_new_tokens=24, collect_steps=True)
    d = m.as_dict()
    assert d["target_passes"] == d["iterations"]
    assert 1 <= d["steps_per_target_pass"] <= 4
    assert all(1 <= w <= 2 for w in d["widths"])
    for s in m.layers.values():
        assert s.accepted <= s.tested
