"""`dsbd-chat generate` and `dsbd-chat models` as a user runs them."""

from __future__ import annotations

import json

import pytest

from app.cli import main


@pytest.mark.parametrize("args,message", [
    (["--mode", "dsbd", "--beams", "4", "--draft-beams", "2"], "draft_beams (W_S=2) must be >= beams (W=4)"),
    (["--mode", "dsbd", "--gamma", "-1"], "gamma must be between 0 and 16"),
    (["--mode", "dsbd", "--threshold", "1.5"], "threshold must be in [0, 1]"),
    (["--mode", "sample", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["--mode", "sample", "--temperature", "nan"], "temperature must be a finite number"),
    (["--mode", "greedy", "--max-tokens", "0"], "max_new_tokens must be between 1"),
    (["--mode", "sps"], "needs a draft model"),
])
def test_invalid_combinations_fail_before_loading(capsys, args, message):
    # The target path does not exist: a parameter error must come first, without touching models.
    rc = main(["generate", "--prompt", "hi", "--target", "missing-model.gguf", *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err
    assert "missing-model" not in err


def test_missing_model_file_is_one_clear_line(capsys):
    rc = main(["generate", "--prompt", "hi", "--target", "missing-model.gguf"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "missing-model.gguf" in err and len(err.splitlines()) == 1


def test_generate_json_on_tiny(capsys, tiny_gguf_path):
    rc = main(["generate", "--preset", "tiny", "--prompt", "Say hello.", "--mode", "dsbd", "--beams", "2",
               "--max-tokens", "8", "--seed", "1", "--n", "2", "--json", "--ctx", "512"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "dsbd" and out["params"]["beams"] == 2
    assert len(out["completions"]) == 2
    for c in out["completions"]:
        assert c["text"] and 1 <= c["tokens"] <= 8
        for key in ("target_passes", "tokens_per_s", "time_to_first_token_s", "steps_per_target_pass",
                    "widths_histogram", "peak_kv_bytes_target", "peak_kv_bytes_draft", "mean_target_logprob"):
            assert key in c["stats"]
    assert out["stats"]["n"] == 2


def test_generate_raw_streams_text(capsys, tiny_gguf_path):
    rc = main(["generate", "--prompt", "The capital of France is", "--raw", "--max-tokens", "4", "--ctx", "256"])
    assert rc == 0
    assert "Paris" in capsys.readouterr().out


def test_models_lists_presets(capsys):
    assert main(["models", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {r["preset"] for r in out["models"]} >= {"tiny", "qwen-coder"}
    assert out["cpu"] and out["llama_weight_repack"].startswith("llama.cpp weight repack")
