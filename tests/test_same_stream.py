"""Same stream (spec §16.10): a DSBD iteration that builds no forest is the plain mode's step, drawing from the
same generator, so a seeded forest mode whose policy never drafts returns the plain mode's answer token for token,
on the real tiny model and its runtime."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.config import DecodeParams
from app.decoding import rowmath, start
from app.decoding.beams import Stopper
from app.decoding.forest_policy import ForestPolicy
from app.decoding.metrics import Metrics
from backends.registry import ModelSpec
from backends.unique import UniquePaths

PROMPTS = ["My favourite animal is the", "def add(a, b):\n    return"]
SEEDS = range(3)
COMMON = dict(beams=4, max_new_tokens=16, temperature=1.0, top_k=0, top_p=1.0)


@pytest.fixture(scope="module")
def tiny(tiny_gguf_path):
    llamacpp = pytest.importorskip("backends.llamacpp")
    model = llamacpp.load(tiny_gguf_path, ModelSpec(source=str(tiny_gguf_path), n_threads=1))
    yield model
    model.close()


@pytest.fixture(autouse=True, params=["compiled", "torch", "numpy"])
def backend(request):
    """Every row-math backend: the CPU default (compiled kernels), torch (float32) and the reference."""
    if request.param == "compiled":
        pytest.importorskip("numba", reason="the compiled kernels need numba")
    before = rowmath.backend()
    rowmath.use(rowmath.make(request.param))
    yield request.param
    rowmath.use(before)


def answer(model, params: DecodeParams, *, draft: bool, never_drafts: bool, prompt: str) -> tuple:
    params = params.validated()
    t = UniquePaths(model.context(rows=max(params.beams, 8), max_tokens=512))
    d = UniquePaths(model.context(rows=max(params.beams, 8), max_tokens=512)) if draft else None
    policy = None
    if never_drafts:  # a draft pass priced out of reach: every iteration is gamma = 0
        policy = ForestPolicy.for_params(params, lambda n: 0.01, lambda n: 1e6)
    metrics = Metrics(mode=params.mode)
    kw = {"policy": policy} if params.mode.startswith("dsbd") else {}
    steps = start(params, target=t, draft=d, prompt=model.tokenizer.encode(prompt),
                  stopper=Stopper(eos_ids=model.tokenizer.eos_ids), metrics=metrics, vocab=model.info.vocab_size,
                  **kw)
    *_, last = steps
    t.close()
    if d is not None:
        d.close()
    if policy is not None:
        assert all(g == 0 for g, _ in policy.chosen)
    return last.output.tokens


# On the torch backend: slow. Its draws are the reference's (tests/test_rowmath.py) and
# test_balanced_that_never_drafts_returns_its_no_forest_answer runs it here on the real model.
@pytest.mark.parametrize("backend", [pytest.param("torch", marks=pytest.mark.slow), "numpy", "compiled"],
                         indirect=True)  # compiled: the plain modes' fused step against the forest's general one
@pytest.mark.parametrize("replacement,plain", [("without", "beam-sample"), ("with", "beam-sample-repl")])
def test_a_forest_mode_that_never_drafts_returns_the_plain_modes_answer(tiny, replacement, plain):
    """Best quality's settings (dsbd without replacement, W_min = W) and the with-replacement candidate, lookup
    sources of the draft only: every seeded answer equals beam-sample's / beam-sample-repl's."""
    forest = DecodeParams(mode="dsbd", replacement=replacement, min_beams=4, draft_beams=8, gamma=3,
                          forest="adaptive", lookup_nodes=2, lookup_sources=("draft",), **COMMON)
    for prompt in PROMPTS:
        for seed in SEEDS:
            want = answer(tiny, DecodeParams(mode=plain, seed=seed, **COMMON), draft=False, never_drafts=False,
                          prompt=prompt)
            got = answer(tiny, replace(forest, seed=seed), draft=True, never_drafts=True, prompt=prompt)
            assert got == want, (prompt, seed)


def test_balanced_that_never_drafts_returns_its_no_forest_answer(tiny):
    """dsbd-mem (Balanced's shape) with a draft whose policy never drafts equals dsbd-mem with no draft model and
    no lookup nodes: each iteration is its plain step (W draws from the carried beam, the best kept)."""
    base = dict(mode="dsbd-mem", replacement="with", min_beams=1, draft_beams=5, gamma=8, threshold=0.9,
                select="best", **COMMON)
    for prompt in PROMPTS:
        for seed in SEEDS:
            want = answer(tiny, DecodeParams(seed=seed, lookup_nodes=0, forest="fixed", **base), draft=False,
                          never_drafts=False, prompt=prompt)
            got = answer(tiny, DecodeParams(seed=seed, forest="adaptive", lookup_nodes=2, lookup_sources=("draft",),
                                            **base), draft=True, never_drafts=True, prompt=prompt)
            assert got == want, (prompt, seed)


@pytest.mark.parametrize("backend", ["compiled", "numpy"], indirect=True)
def test_one_beam_dsbd_that_never_drafts_returns_sample_s_answer(tiny):
    """At one beam the plain mode (`sample`) runs its own one-row loop, on the compiled backend its fused step: a
    dsbd forest of one beam whose policy never drafts draws from the same stream through the general row math and
    returns the same answer, token for token."""
    one = dict(COMMON, beams=1, max_new_tokens=24)
    forest = DecodeParams(mode="dsbd", replacement="with", min_beams=1, draft_beams=2, gamma=3, forest="adaptive",
                          lookup_nodes=2, lookup_sources=("draft",), **one)
    for prompt in PROMPTS:
        for seed in SEEDS:
            want = answer(tiny, DecodeParams(mode="sample", seed=seed, **one), draft=False, never_drafts=False,
                          prompt=prompt)
            got = answer(tiny, replace(forest, seed=seed), draft=True, never_drafts=True, prompt=prompt)
            assert got == want, (prompt, seed)
