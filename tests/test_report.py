"""The bench's plots: speed vs quality with its Pareto front, acceptance and widths (the report's panels)."""

from __future__ import annotations

from app.compare.report import pareto, plot_bench


def test_pareto_keeps_only_non_dominated_points():
    pts = [(10, -1.0), (6, -0.5), (7, -0.9), (3, -0.6), (5, -0.4)]
    assert pareto(pts) == [(10, -1.0), (7, -0.9), (6, -0.5), (5, -0.4)]


def test_plot_writes_speed_acceptance_and_width_pngs(tmp_path):
    def mode(tps, lp, acc=None, widths=None):
        return {"tokens_per_s_median": tps, "mean_target_logprob": lp, "acceptance_by_depth": acc or {},
                "widths_histogram": widths or {}}

    result = {"config": {"models": {"target": "synthetic"}}, "summary": {
        "sample": mode(10, -1.0), "beam-sample": mode(6, -0.5),
        "sps": mode(8, -1.1, {"1": 0.7, "2": 0.6, "3": 0.8}),
        "dsbd": mode(4, -0.9, {"1": 0.6, "2": 0.75}, {"1": 30, "2": 5, "4": 3})}}
    written = plot_bench(result, tmp_path / "out.png")
    assert [p.name for p in written] == ["out.png", "out-acceptance.png", "out-widths.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000
