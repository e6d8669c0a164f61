"""The README's measured figures and the presets' descriptions are what scripts/figures.py writes from the JSON
in docs/measurements: a figure edited by hand, or JSON re-measured without regenerating, fails here."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "figures.py"


@pytest.fixture(scope="module")
def figures():
    spec = importlib.util.spec_from_file_location("figures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_and_presets_match_the_json(figures):
    diff = figures.differences()
    assert not diff, "run `python scripts/figures.py`:\n" + diff


def test_every_cited_json_names_its_machine(figures):
    for f in ("rowmath-same-code.json", "rowmath-projected-rtx4090-7b-code.json", "qwen-cache-code.json",
              "draft-cost.json", "first-start.json", "attachments.json"):
        assert figures.machine(f)["cores"] >= 1
    assert "not run on a GPU" in figures.on("rowmath-projected-rtx4090-7b-code.json")
    with pytest.raises(ValueError, match="unrecorded"):
        figures.machine("load-progress.json")


def test_claim_rule(figures):
    data = {"config": {"settings": {"bq": {"mode": "dsbd", "beams": 4, "min_beams": 4, "replacement": "without"},
                                    "bal": {"mode": "dsbd-mem", "beams": 4, "min_beams": 1}}},
            "summary": {"bq": {"speed_vs_beam-sample": 1.5, "drafted_iterations": 0.0},
                        "bal": {"speed_vs_beam-sample": 1.5, "drafted_iterations": 0.5}}}
    assert figures.speed(data, "bq", "beam-sample") == "at beam sampling's speed"
    data["summary"]["bq"]["speed_vs_beam-sample"] = 0.81  # slower without drafting: the figure, not "at"
    assert figures.speed(data, "bq", "beam-sample") == "0.81x beam sampling's speed (it drafted nothing)"
    data["summary"]["bq"]["speed_vs_beam-sample"] = 1.5
    data["summary"]["bq"]["drafted_iterations"] = 0.2
    assert figures.speed(data, "bq", "beam-sample") == "1.50x beam sampling's speed"
    assert figures.speed(data, "bal", "beam-sample").endswith("(a different law)")


def test_the_glossary_states_every_setting_once(figures):
    """Each DecodeParams field (the mode aside: the README's modes table) has its one row in app.config.KNOBS,
    which the README's glossary, the CLI's help, the settings panel and the API schema all read."""
    from dataclasses import fields

    from app.config import KNOBS, DecodeParams

    settings = {f.name for f in fields(DecodeParams)} - {"mode"}
    assert settings <= set(KNOBS) and set(KNOBS) - settings == {"cost_profile"}  # a model setting, on the CLI
    glossary = figures.knobs()
    assert all(f"| {k.name} | `{k.flag}" in glossary for k in KNOBS.values())
