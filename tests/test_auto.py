"""AutoPolicy: cost curves, acceptance estimates and the choice per quality level (pure: no models)."""

from __future__ import annotations

import pytest

from app.engine.auto import PRIOR_ACCEPTANCE, AutoPolicy, CostCurve, describe
from app.compare.bench import parse_mode
from app.config import ConfigError, DecodeParams

BASE = DecodeParams(mode="sample", temperature=1.0, top_k=20, beams=4)
CPU = ({1: 0.080, 8: 0.25, 32: 0.60, 64: 1.0}, {1: 0.045, 8: 0.11, 32: 0.36, 64: 0.76})  # compute-bound
GPU = ({1: 0.020, 8: 0.020, 32: 0.022, 64: 0.026}, {1: 0.006, 8: 0.006, 32: 0.007, 64: 0.008})  # flat


def test_cost_curve_interpolates_and_extends_the_last_slope():
    c = CostCurve.of({1: 1.0, 4: 4.0, 8: 6.0})
    assert c(1) == 1.0 and c(2) == 2.0 and c(6) == 5.0
    assert c(12) == 8.0  # slope 0.5 of the last segment
    assert c(0) == 1.0
    spiked = CostCurve.of({1: 1.0, 2: 9.0, 4: 4.0})  # n = 2 measured while another process ran
    assert spiked.points == ((1, 1.0), (2, 4.0), (4, 4.0))


def test_tau_follows_the_spec_formula_for_equal_acceptance():
    p = AutoPolicy.from_costs(*CPU)
    sps = DecodeParams(mode="sps", gamma=4).validated()
    a = PRIOR_ACCEPTANCE
    assert p.tokens_per_pass(sps) == pytest.approx((1 - a ** 5) / (1 - a))
    assert p.tokens_per_pass(BASE.validated()) == 1.0


def test_compute_bound_cpu_picks_sample_and_beam_sample():
    p = AutoPolicy.from_costs(*CPU)
    assert p.choose(BASE, "fast").mode == "sample"
    assert p.choose(BASE, "beam").mode == "beam-sample"


def test_flat_gpu_pass_picks_drafting_and_long_drafts_with_high_acceptance():
    p = AutoPolicy.from_costs(*GPU)
    fast = p.choose(BASE, "fast")
    assert fast.mode == "sps"
    beam = p.choose(BASE, "beam")
    assert beam.mode == "dsbd" and beam.min_beams == 2  # the beam level keeps >= 2 beams
    for _ in range(20):  # the draft agrees almost always: deeper drafts pay
        p.observe(fast, {"acceptance_by_depth": {d: {"attempted": 10, "passed": 10} for d in "123456"},
                         "tokens_per_s": None})
    assert p.choose(BASE, "fast").gamma > fast.gamma


def test_observe_lowers_acceptance_and_the_choice_follows():
    p = AutoPolicy.from_costs(*GPU)
    sps = p.choose(BASE, "fast")
    for _ in range(30):  # the draft never agrees: drafting is pure cost
        p.observe(sps, {"acceptance_by_depth": {"1": {"attempted": 10, "passed": 0}}, "tokens_per_s": None})
    assert p.pass_rates(sps, 3) == pytest.approx([0, 0, 0], abs=1e-3)
    assert p.choose(BASE, "fast").mode == "sample"


def test_measured_speed_corrects_the_projection_per_mode():
    p = AutoPolicy.from_costs(*CPU)
    s = BASE.validated()
    assert p.projected_tps(s) == pytest.approx(12.5)
    p.observe(s, {"target_passes": 50, "decode_s": 5.0})  # 0.1 s per pass: sampler time the model leaves out
    assert p.projected_tps(s) == pytest.approx(10.0)
    p.observe(s, {"target_passes": 2, "decode_s": 5.0})  # too few passes to say anything
    assert p.projected_tps(s) == pytest.approx(10.0)


def test_a_short_beam_answer_after_many_steps_does_not_flip_the_beam_level():
    # The code-suite case: a 21-token beam-sample answer that took 100 beam steps (1.2 tok/s against a
    # usual 6). Each pass took as long as projected, so beam sampling stays the CPU's beam-level choice.
    p = AutoPolicy.from_costs(*CPU)
    beam = p.choose(BASE, "beam")
    assert beam.mode == "beam-sample"
    per_pass = p.iteration_s(beam)
    p.observe(beam, {"target_passes": 100, "decode_s": 100 * per_pass, "new_tokens": 21,
                     "tokens_per_s": 21 / (100 * per_pass)})
    assert p.choose(BASE, "beam") == beam
    assert p.projected_tps(beam) == pytest.approx(1 / per_pass)


def test_levels_offer_only_their_modes_and_validate():
    p = AutoPolicy.from_costs(*CPU)
    assert {c.mode for c in p.candidates(BASE, "fast")} == {"sample", "sps"}
    assert {c.mode for c in p.candidates(BASE, "beam")} == {"beam-sample", "dsbd"}
    dynamic = p.candidates(BASE, "dynamic")
    assert {c.mode for c in dynamic} == {"dsbd"} and all(c.min_beams == c.beams == BASE.beams for c in dynamic)
    assert 0 in {c.gamma for c in dynamic}  # no draft is a candidate: it wins where drafting does not pay
    no_draft = AutoPolicy.from_costs(CPU[0])
    assert {c.mode for c in no_draft.candidates(BASE, "fast")} == {"sample"}
    with pytest.raises(ConfigError):
        p.choose(BASE, "best")
    with pytest.raises(ValueError, match="the setting auto picked"):
        p.observe(DecodeParams(mode="auto"), {})


def test_describe_round_trips_through_the_bench_syntax():
    p = AutoPolicy.from_costs(*GPU)
    for level in ("fast", "beam", "dynamic"):
        for c in p.candidates(BASE, level):
            assert parse_mode(describe(c), BASE)[1] == c


def test_dynamic_keeps_w_beams_and_drafts_only_where_it_pays():
    """The dynamic level holds beam sampling's law (W_min = W); the pass costs decide the depth."""
    cpu, gpu = AutoPolicy.from_costs(*CPU), AutoPolicy.from_costs(*GPU)
    on_gpu = gpu.choose(BASE, "dynamic")
    assert on_gpu.mode == "dsbd" and on_gpu.min_beams == on_gpu.beams and on_gpu.gamma > 0
    assert cpu.choose(BASE, "dynamic").gamma == 0  # a 19-token pass costs ~4 single ones here: no draft
