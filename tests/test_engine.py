"""The engine on the real `tiny` preset (SmolLM2-135M): every mode end to end, equivalences that must hold
token for token, cancellation that leaves both runtimes' caches consistent, and context-limit errors.

Each property runs on every runtime pairing. Where the PyTorch runtime adds nothing a faster test does not hold
(the mode's path is the llama.cpp pairing's, the runtime's own contract is tests/test_pytorch.py's), its runs are
`slow` (SLOW_RUNS): the default suite keeps, per PyTorch pairing, a forest mode end to end and under
cancellation, the token-for-token greedy equivalence on the float32 target, and the draft's origin marks."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from app.engine.auto import describe
from app.compare.bench import parse_mode
from app.config import MODES, ConfigError, DecodeParams
from backends.registry import ModelSpec
from app.engine.engine import Engine, PromptTooLong
from app.engine.interface import NoModelLoaded

MESSAGES = [{"role": "user", "content": "List three colours."}]


# Every runtime as target and as draft (pairings: target/draft).
@pytest.fixture(scope="module", params=[("llamacpp", "llamacpp"), ("pytorch", "llamacpp"), ("llamacpp", "pytorch")],
                ids=["llamacpp", "pytorch", "pytorch-draft"])
def engine(request, tiny_gguf_path):
    target, draft = request.param
    e = Engine.load(ModelSpec(source="tiny", backend=target, n_ctx=512),
                    ModelSpec(source="tiny", backend=draft, n_ctx=512))
    yield e
    e.close()


def _runs(pairs, modes=None) -> set[str]:
    return {p if modes is None else f"{p}-{m}" for p in pairs for m in (modes or [None])}


# The PyTorch pairings' runs left to the slow set, by test (tests/conftest.py marks them).
_TORCH = ("pytorch", "pytorch-draft")
SLOW_RUNS = {
    "test_every_mode_completes": _runs(_TORCH, MODES) - {"pytorch-greedy", "pytorch-dsbd", "pytorch-draft-dsbd"},
    "test_greedy_equivalent_settings_match_greedy_token_for_token": {"pytorch-draft"},
    "test_self_draft_is_almost_always_accepted": _runs(_TORCH),
    "test_answer_says_which_text_the_draft_wrote": _runs(_TORCH, ["sps", "dsbd", "dsbd-mem"]) - {"pytorch-draft-dsbd"},
    "test_cancel_leaves_caches_consistent": _runs(_TORCH, ["dsbd", "dsbd-mem", "sps", "beam-sample"])
    - {"pytorch-dsbd", "pytorch-draft-dsbd"},
}


def final(events):
    last = None
    for last in events:
        pass
    assert last is not None and last.done
    return last


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_completes(engine, mode):
    ev = final(engine.chat(MESSAGES, DecodeParams(mode=mode, max_new_tokens=8, seed=1, beams=2)))
    assert ev.text.strip()
    assert 1 <= ev.stats["new_tokens"] <= 8
    assert ev.stats["target_passes"] >= 1
    assert ev.stats["mean_target_logprob"] < 0


def test_greedy_equivalent_settings_match_greedy_token_for_token(engine, request):
    """top-k 1 makes every drafted mode greedy. Token for token where a forest pass gives the logits of one-token
    passes (the float32 PyTorch target); a quantized llama.cpp target's forest pass moves logits slightly
    (docs/measurements/forest-shift.md), which can flip a near-tie argmax on some CPUs (seen on an AVX2 EPYC), so
    there the answers must agree on their opening and stay greedy-like (the same first tokens)."""
    exact = request.node.callspec.id == "pytorch"
    greedy = final(engine.chat(MESSAGES, DecodeParams(mode="greedy", max_new_tokens=16))).text
    for mode, kw in [("sps", {}), ("dsbd", dict(beams=1, draft_beams=2)), ("dsbd-mem", dict(beams=2))]:
        ev = final(engine.chat(MESSAGES, DecodeParams(mode=mode, max_new_tokens=16, top_k=1, seed=3, **kw)))
        if exact:
            assert ev.text == greedy, mode
        else:
            assert ev.text[:12] == greedy[:12], mode


def test_self_draft_is_almost_always_accepted(engine):
    # The tiny preset drafts for itself: p == q up to batch-size rounding, so acceptance is near 1.
    ev = final(engine.chat(MESSAGES, DecodeParams(mode="sps", max_new_tokens=24, seed=5, gamma=3)))
    layers = ev.stats["acceptance_by_depth"].values()
    accepted, tested = sum(s["accepted"] for s in layers), sum(s["tested"] for s in layers)
    assert accepted >= 0.9 * tested > 0
    assert ev.stats["steps_per_target_pass"] > 2


@pytest.mark.parametrize("mode", ["sps", "dsbd", "dsbd-mem"])
def test_answer_says_which_text_the_draft_wrote(engine, mode):
    ev = final(engine.chat(MESSAGES, DecodeParams(mode=mode, max_new_tokens=24, seed=5, beams=2)))
    assert "".join(t for t, _ in ev.segments) == ev.text
    assert 0 < ev.stats["draft_tokens"] <= ev.stats["new_tokens"]
    assert any(d for _, d in ev.segments)  # the tiny preset drafts for itself: most tokens come from it


@pytest.mark.parametrize("mode", ["dsbd", "dsbd-mem", "sps", "beam-sample"])
def test_cancel_leaves_caches_consistent(engine, mode):
    params = DecodeParams(mode=mode, max_new_tokens=24, seed=7, beams=3, temperature=0.8)
    reference = final(engine.chat(MESSAGES, params)).text
    cancel = threading.Event()
    events = engine.chat(MESSAGES, params, cancel=cancel)
    for i, _ in enumerate(events):
        if i == 1:
            cancel.set()
    assert final(engine.chat(MESSAGES, params)).text == reference


def test_prompt_too_long_names_token_counts(engine):
    long = [{"role": "user", "content": "word " * 600}]
    with pytest.raises(PromptTooLong, match=r"prompt is \d+ tokens.*of the 512-token context"):
        engine.chat(long, DecodeParams(mode="greedy", max_new_tokens=8))


def test_bad_parameters_fail_before_work(engine):
    with pytest.raises(ConfigError, match="draft_beams"):
        engine.chat(MESSAGES, DecodeParams(mode="dsbd", beams=4, draft_beams=2))
    with pytest.raises(ConfigError, match="threshold"):
        engine.chat(MESSAGES, DecodeParams(mode="dsbd", threshold=1.5))


def test_auto_runs_what_it_names_learns_from_every_answer_and_forgets_on_swap(tiny_gguf_path):
    e = Engine.load(ModelSpec(source="tiny", n_ctx=512), ModelSpec(source="tiny", n_ctx=512))
    try:
        base = DecodeParams(max_new_tokens=12, seed=4, temperature=0.8, beams=2)
        final(e.chat(MESSAGES, replace(base, mode="sps")))  # given before auto is first asked for
        assert e.policy is None  # users who never pick auto never pay for timing the passes
        first = final(e.chat(MESSAGES, replace(base, mode="auto", quality="dynamic")))
        info = first.stats["auto"]
        # calibrated by this answer: timed now, or read from the pass-cost cache of an earlier load (~0 s)
        assert info["quality"] == "dynamic" and info["calibration_s"] >= 0 and e.policy is not None
        assert ("sps", 2, 1, 1) in e.policy.rates  # the earlier sps answer was replayed into the new policy
        chosen = parse_mode(info["setting"], base)[1]
        assert first.stats["mode"] == chosen.mode and chosen.mode in ("dsbd", "dsbd-mem")
        assert final(e.chat(MESSAGES, chosen)).text == first.text  # auto is exactly the setting it names
        expect = describe(e.policy.choose(replace(base, mode="auto"), "dynamic"))
        again = final(e.chat(MESSAGES, replace(base, mode="auto", quality="dynamic")))
        assert "calibration_s" not in again.stats["auto"] and again.stats["auto"]["setting"] == expect
        e.swap(*e.specs)
        assert e.policy is None  # pass costs and acceptance belonged to the models before the swap
    finally:
        e.close()


def test_pytorch_rows_stay_where_they_are_computed_and_answers_do_not_move(tiny_gguf_path, monkeypatch):
    """A PyTorch target and draft hand their logits to the row math as tensors on their own device (here the CPU;
    on a GPU the same path keeps them there): every mode answers exactly as with host numpy rows, seeded."""
    from app.decoding import rowmath
    from app.decoding.rowmath import tensors
    from backends.pytorch.runtime import PyTorchContext

    monkeypatch.setattr(rowmath, "_DEFAULT", [tensors.TorchRows("cpu")])  # the suite's default is the reference
    evaluate = PyTorchContext.evaluate
    handed: set[str] = set()

    def spy(self, forest):
        out = evaluate(self, forest)
        handed.add(type(out.roots).__module__.split(".")[0])
        return out

    monkeypatch.setattr(PyTorchContext, "evaluate", spy)
    modes = [m for m in MODES if m != "auto"]
    answers: dict[str, dict] = {}
    for where in ("device", "host"):
        with monkeypatch.context() as m:
            if where == "host":
                m.setattr(tensors.TorchRows, "reads", lambda self, device: False)
            handed.clear()
            e = Engine.load(ModelSpec(source="tiny", backend="pytorch", n_ctx=512),
                            ModelSpec(source="tiny", backend="pytorch", n_ctx=512))
            try:
                for mode in modes:
                    ev = final(e.chat(MESSAGES, DecodeParams(mode=mode, max_new_tokens=10, seed=7, beams=2,
                                                             temperature=0.9)))
                    answers.setdefault(mode, {})[where] = (ev.text, ev.stats["new_tokens"],
                                                           ev.stats["mean_target_logprob"])
            finally:
                e.close()
            assert handed == ({"torch"} if where == "device" else {"numpy"})
    for mode in modes:
        assert answers[mode]["device"] == answers[mode]["host"], mode


def test_prepared_contexts_serve_the_first_answers_of_every_width(tiny_gguf_path, monkeypatch):
    """prepare() makes the llama.cpp contexts after a load, so no answer that follows waits to create one: DSBD,
    beam sampling at the most beams a request may ask for, and sps all run on them."""
    e = Engine.load(ModelSpec(source="tiny", n_ctx=512), ModelSpec(source="tiny", n_ctx=512))
    try:
        e.prepare()
        made = []
        for m in (e.target, e.draft):
            make = m.context
            monkeypatch.setattr(m, "context", lambda *a, _make=make, **k: made.append(k) or _make(*a, **k))
        for params in (DecodeParams(mode="dsbd", beams=4, max_new_tokens=8, seed=1),
                       DecodeParams(mode="beam-sample", beams=16, max_new_tokens=4, seed=1),
                       DecodeParams(mode="sps", max_new_tokens=8, seed=1)):
            assert final(e.chat(MESSAGES, params)).stats["new_tokens"] > 0
        assert made == []
    finally:
        e.close()


def test_close_waits_for_a_pass_being_timed_and_the_timing_then_stops(tiny_gguf_path, monkeypatch, tmp_path):
    """close() while the pass costs are timed in the background (in-process, as `--no-worker` runs): the pass
    being timed finishes before the weights are freed, no other pass is timed after it, and the timing thread
    ends with a clear error instead of running on freed weights."""
    from app.engine import timing

    monkeypatch.setenv("DSBD_CHAT_CACHE", str(tmp_path))  # nothing cached: every point is timed
    e = Engine.load(ModelSpec(source="tiny", n_ctx=512), None)
    entered, release, events = threading.Event(), threading.Event(), []
    measure = timing.measure_costs

    def slow(model, ns, **kw):
        events.append(f"timing {ns[0]}")
        entered.set()
        release.wait(10)
        out = measure(model, ns, **kw)
        events.append(f"timed {ns[0]}")
        return out

    monkeypatch.setattr(timing, "measure_costs", slow)
    errors: list = []
    worker = threading.Thread(target=lambda: _keep_error(e.costs, errors))
    worker.start()
    assert entered.wait(10)
    closer = threading.Thread(target=lambda: (e.close(), events.append("closed")))
    closer.start()
    closer.join(0.3)
    assert closer.is_alive() and "closed" not in events  # the close waits for the pass being timed
    release.set()
    worker.join(20)
    closer.join(10)
    first = events[0].split()[1]
    assert events == [f"timing {first}", f"timed {first}", "closed"]
    assert len(errors) == 1 and isinstance(errors[0], NoModelLoaded) and "closed" in str(errors[0])


def _keep_error(fn, errors: list) -> None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001
        errors.append(err)


def test_close_waits_for_a_context_being_prepared_and_prepare_then_stops(tiny_gguf_path, monkeypatch):
    """close() while prepare() makes a context in the background: the context is finished before the weights are
    freed, and prepare makes nothing after the close."""
    e = Engine.load(ModelSpec(source="tiny", n_ctx=512), ModelSpec(source="tiny", n_ctx=512))
    entered, release, events = threading.Event(), threading.Event(), []
    make = e.target.context

    def slow(*a, **k):
        entered.set()
        release.wait(10)
        events.append("context made")
        return make(*a, **k)

    monkeypatch.setattr(e.target, "context", slow)
    monkeypatch.setattr(e.draft, "context", lambda *a, **k: events.append("draft context") or make(*a, **k))
    worker = threading.Thread(target=e.prepare)
    worker.start()
    assert entered.wait(10)
    closer = threading.Thread(target=lambda: (e.close(), events.append("closed")))
    closer.start()
    closer.join(0.3)
    assert closer.is_alive() and events == []  # the close waits for the context being made
    release.set()
    worker.join(10)
    closer.join(10)
    assert events == ["context made", "closed"]  # and nothing is made after it


TIMES = ("prefill_s", "time_to_first_token_s", "decode_s", "tokens_per_s", "pass_s", "pass_s_by_tokens", "phase_s")


@pytest.mark.parametrize("backend", ["llamacpp", "pytorch"])
def test_the_plain_modes_fused_step_streams_the_general_paths_events(tiny_gguf_path, monkeypatch, backend):
    """The plain modes on the compiled row math take one fused step per token (one row or several), DSBD its plain
    step, and the runtimes' one-row shortcuts: every event (its text, token count, live beams), the answer and every
    stat but the times equal those of the general row math (the fused steps turned off), seeded; with EOS, a stop
    string, temperatures, beams and a truncated warp (which takes the general path either way)."""
    pytest.importorskip("numba", reason="the compiled kernels need numba")
    from app.decoding import rowmath
    from app.decoding.rowmath.compiled import CompiledRows

    monkeypatch.setattr(rowmath, "_DEFAULT", [rowmath.make("compiled")])
    settings = [dict(mode="greedy"), dict(mode="sample"), dict(mode="sample", temperature=0.7),
                dict(mode="sample", stop=("\n",)), dict(mode="sample", top_k=20),
                dict(mode="beam-sample", beams=1), dict(mode="beam-sample-repl", beams=1),
                dict(mode="beam-sample", beams=2), dict(mode="beam-sample-repl", beams=3, temperature=0.8),
                # DSBD's plain step (the extra layer, a layer of lookup nodes only) on the fused step too
                dict(mode="dsbd", beams=2, min_beams=2, replacement="without"),
                dict(mode="dsbd", beams=3, min_beams=1, temperature=0.8), dict(mode="dsbd-mem", beams=2)]
    seeds = range(2)
    if backend == "pytorch":  # rows as tensors read in place: the fused steps' other input (slow: short answers)
        settings, seeds = settings[:2] + settings[-1:], [1]
    e = Engine.load(ModelSpec(source="tiny", backend=backend, n_ctx=512))
    try:
        streams: dict = {}
        for arm in ("fused", "general"):
            with monkeypatch.context() as m:
                if arm == "general":
                    m.setattr(CompiledRows, "plain_step", lambda self, *a: None)
                    m.setattr(CompiledRows, "beam_step", lambda self, *a: None)
                for i, kw in enumerate(settings):
                    for seed in seeds:
                        params = DecodeParams(max_new_tokens=16 if seed else 120, seed=seed, **kw)
                        events = list(e.chat(MESSAGES, params))
                        stats = {k: v for k, v in events[-1].stats.items() if k not in TIMES}
                        streams.setdefault((i, seed), {})[arm] = (
                            [(ev.text, ev.tokens, ev.live_beams, ev.done) for ev in events], stats)
        for key, arms in streams.items():
            assert arms["fused"] == arms["general"], (settings[key[0]], key[1])
        reasons = {arms["fused"][1]["finish_reason"] for arms in streams.values()}
        assert reasons == ({"stop", "length"} if backend == "llamacpp" else {"length"}), reasons
    finally:
        e.close()
