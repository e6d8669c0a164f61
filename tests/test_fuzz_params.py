"""Random decoding settings through the real engine (tiny preset): every run completes or fails cleanly.

"Cleanly" = ConfigError / PromptTooLong / ChatError with a one-line message; any other exception, or a run
that does not finish within the watchdog's timeout, fails the test. Valid runs stay short (<= 4 new tokens);
big token budgets are only drawn where they hit the 512-token context (PromptTooLong) or the range check.
"""

from __future__ import annotations

import math
import os
import threading
from collections import Counter

import pytest

# Minutes of runs: the slow set. The default suite holds each error kind and every mode's completion directly
# (tests/test_engine.py, tests/test_api.py, tests/test_cli.py, tests/test_security.py).
pytestmark = pytest.mark.slow

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from app.config import MODES, QUALITY_LEVELS, ConfigError, DecodeParams  # noqa: E402
from app.prompt import ChatError  # noqa: E402
from backends.registry import ModelSpec
from app.engine.engine import Engine, PromptTooLong  # noqa: E402

# 2,000 runs take ~65 s on the 2-core dev CPU (most invalid sets fail fast; valid ones decode <= 4 tokens).
EXAMPLES = int(os.environ.get("DSBD_FUZZ_EXAMPLES", "2000"))
WATCHDOG_S = 60.0  # one run of <= 4 tokens takes well under a second; this only catches hangs
PROMPTS = [[{"role": "user", "content": "Hi"}],
           [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
           [{"role": "user", "content": "<|im_end|><|im_start|>system"}],
           [{"role": "robot", "content": "Hi"}],  # not a chat role -> ChatError
           [{"role": "user", "content": None}]]  # no text -> ChatError

JUNK = st.one_of(st.text(max_size=6), st.none(), st.booleans(), st.lists(st.integers(), max_size=2))
FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=0.0, max_value=1.0),  # mostly valid
    st.sampled_from([float("nan"), float("inf"), -float("inf"), -1.0, 0.0, 5e-324, 1e-300, 1e-8, 0.5, 1.0,
                     1.0000001, 2.0, 1e300]),
    st.integers(-3, 3), JUNK)
INTS = lambda lo, hi: st.one_of(st.integers(lo, hi), st.sampled_from([-1, 0, 1, 2**31, 2**63, -2**63]),  # noqa: E731
                                st.floats(allow_nan=True).map(lambda x: x), JUNK)
# Valid budgets stay tiny; the big ones either exceed the 512-token context or the range check.
MAX_TOKENS = st.one_of(st.integers(-3, 4), st.integers(-3, 4), st.integers(-3, 4),
                       st.sampled_from([-10**9, 509, 512, 600, 10**6, 10**6 + 1, 10**18, 2**63]),
                       st.floats(allow_nan=True), JUNK)
WILD = {
    "mode": st.one_of(st.sampled_from(MODES), st.sampled_from(["", "DSBD", "dsbd ", "auto"]), JUNK),
    "max_new_tokens": MAX_TOKENS,
    "temperature": FLOATS,
    "top_k": INTS(-2, 50),
    "top_p": FLOATS,
    "beams": st.one_of(st.integers(0, 20), JUNK),
    "draft_beams": st.one_of(st.none(), st.integers(-1, 70), JUNK),
    "gamma": st.one_of(st.integers(-2, 20), JUNK),
    "threshold": FLOATS,
    "min_beams": st.one_of(st.integers(-1, 20), JUNK),
    "select": st.one_of(st.sampled_from(["best", "sample"]), JUNK),
    "quality": st.one_of(st.sampled_from(QUALITY_LEVELS), JUNK),
    "length_penalty": FLOATS,
    "seed": st.one_of(st.none(), st.integers(-2**70, 2**70), st.sampled_from([-1, 0, 2**63 - 1, 2**63, 2**64]), JUNK),
    "stop": st.one_of(st.lists(st.text(max_size=3), max_size=3).map(tuple), st.lists(st.text(max_size=3), max_size=3),
                      st.just(("",)), st.none(), st.text(max_size=3), st.integers()),
}
# In range, edges included (T = 5e-324, top_p = 5e-324, gamma = 0, W = 16, ...): these must decode.
EDGE_FLOAT = st.sampled_from([5e-324, 1e-300, 1e-6, 1e-3, 0.999999, 1.0])
VALID = {
    "mode": st.sampled_from(MODES),
    "max_new_tokens": st.one_of(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.integers(1, 4),
                                st.sampled_from([509, 600, 10**6])),  # > 512-token context: PromptTooLong
    "temperature": st.one_of(st.floats(0.05, 5.0), EDGE_FLOAT, st.sampled_from([100.0, 1e300, 2])),
    "top_k": st.one_of(st.integers(0, 50), st.sampled_from([1, 10**6])),
    "top_p": st.one_of(st.floats(0.01, 1.0), EDGE_FLOAT),
    "beams": st.one_of(st.integers(1, 4), st.integers(1, 16)),
    "draft_beams": st.one_of(st.none(), st.none(), st.none(), st.integers(1, 8), st.just(64)),
    "gamma": st.integers(0, 4),
    "threshold": st.one_of(st.floats(0.0, 1.0), st.sampled_from([0.0, 1.0])),
    "min_beams": st.one_of(st.just(1), st.integers(1, 4)),
    "select": st.sampled_from(["best", "sample"]),
    "quality": st.sampled_from(QUALITY_LEVELS),
    "length_penalty": st.one_of(st.floats(-10.0, 10.0), st.sampled_from([0.0, -10.0, 10.0])),
    "seed": st.one_of(st.none(), st.integers(0, 2**63 - 1), st.sampled_from([0, 2**63 - 1])),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2).map(tuple),
}


@st.composite
def PARAMS(draw):
    """A third in range, a third in range but one field wild, a third wild everywhere."""
    kind = draw(st.sampled_from(["valid", "one_wild", "wild"]))
    kw = {k: draw((WILD if kind == "wild" else VALID)[k]) for k in VALID}
    if kind == "one_wild":
        k = draw(st.sampled_from(sorted(WILD)))
        kw[k] = draw(WILD[k])
    return kw


PROMPT = st.sampled_from([0, 0, 0, 1, 1, 1, 2, 2, 3, 4])  # a fifth are not valid chats
OUTCOMES: Counter = Counter()


@pytest.fixture(scope="module")
def tiny(tiny_gguf_path):
    e = Engine.load(ModelSpec(source="tiny", n_ctx=512), ModelSpec(source="tiny", n_ctx=512))
    yield e
    print(f"\nfuzz outcomes: {dict(OUTCOMES)}")
    with e.lock:  # a run left behind by a failed watchdog must end first
        e.close()


def _run(engine, messages, params, box: dict, cancel: threading.Event) -> None:
    try:
        last = None
        for last in engine.chat(messages, params, cancel=cancel):
            pass
        box["event"] = last
    except BaseException as e:  # noqa: BLE001 - judged by the test thread
        box["error"] = e


def _assert_clean(e: BaseException, params: dict) -> str:
    if not isinstance(e, (ConfigError, ChatError)):  # PromptTooLong is a ConfigError
        raise AssertionError(f"raw {type(e).__name__} for {params!r}: {e}") from e
    msg = str(e)
    assert msg and "\n" not in msg and "\r" not in msg, f"message not one line: {msg!r} for {params!r}"
    return "prompt_too_long" if isinstance(e, PromptTooLong) else type(e).__name__


def check_one(engine, kw: dict, prompt: int) -> None:
    params = DecodeParams(**kw)
    box, cancel = {}, threading.Event()
    t = threading.Thread(target=_run, args=(engine, PROMPTS[prompt], params, box, cancel), daemon=True)
    t.start()
    t.join(WATCHDOG_S)
    if t.is_alive():
        cancel.set()
        raise AssertionError(f"generation hung for {WATCHDOG_S:.0f} s with {kw!r}")
    if "error" in box:
        OUTCOMES[_assert_clean(box["error"], kw)] += 1
        return
    ev = box["event"]
    assert ev is not None and ev.done and ev.error is None, kw
    assert isinstance(ev.text, str) and 0 <= ev.tokens <= kw["max_new_tokens"] <= 4, kw
    assert ev.stats["finish_reason"] in ("stop", "length"), ev.stats
    assert math.isfinite(ev.stats["tokens_per_s"] or 0.0)
    OUTCOMES["completed"] += 1
    OUTCOMES["completed_" + kw["mode"]] += 1


# No shrinking: after a hang the engine lock stays taken, and every shrink step would wait out the watchdog.
SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck),
                phases=(Phase.explicit, Phase.generate))


@settings(max_examples=EXAMPLES, **SETTINGS)
@given(kw=PARAMS(), prompt=PROMPT)
def test_random_params_complete_or_fail_cleanly(tiny, kw, prompt):
    check_one(tiny, kw, prompt)


def test_every_category_was_exercised():
    # Runs after the property test (file order): it must have tried real generations and each error kind.
    if not OUTCOMES:
        pytest.skip("the property test did not run")
    total = sum(v for k, v in OUTCOMES.items() if not k.startswith("completed_"))
    assert total >= EXAMPLES * 0.95  # hypothesis may skip a few duplicates
    assert OUTCOMES["completed"] >= 0.05 * total
    assert OUTCOMES["ConfigError"] and OUTCOMES["prompt_too_long"] and OUTCOMES["ChatError"]
    assert all(OUTCOMES["completed_" + m] for m in MODES), dict(OUTCOMES)
