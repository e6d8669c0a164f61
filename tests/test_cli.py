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


def test_each_flag_says_what_the_glossary_says(capsys):
    import re

    from app.config import KNOBS

    with pytest.raises(SystemExit):
        main(["generate", "-h"])
    text = re.sub(r"\s+", "", capsys.readouterr().out)  # as argparse wraps it
    for k in KNOBS.values():
        assert k.flag in text and re.sub(r"\s+", "", k.help) in text, k.flag


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



def test_unreadable_file_fails_before_loading(capsys, tmp_path):
    (tmp_path / "pic.png").write_bytes(b"\x89PNG\r\n\x1a\nrest")
    for path, message in [(tmp_path / "nope.txt", "nope.txt: no such file"),
                          (tmp_path / "pic.png", "pic.png is a PNG image, not text")]:
        rc = main(["generate", "--prompt", "hi", "--target", "missing-model.gguf", "--file", str(path)])
        err = capsys.readouterr().err
        assert rc == 2 and message in err and "missing-model" not in err


def test_too_many_files_is_one_clear_line(capsys, tmp_path):
    from app.attachments import MAX_FILES

    paths = []
    for i in range(MAX_FILES + 1):
        (tmp_path / f"f{i}.txt").write_text("x")
        paths += ["--file", str(tmp_path / f"f{i}.txt")]
    rc = main(["generate", "--prompt", "hi", "--target", "missing-model.gguf", *paths])
    assert rc == 2 and f"at most {MAX_FILES} per message" in capsys.readouterr().err


def test_generate_with_files_on_tiny(capsys, tmp_path, tiny_gguf_path):
    (tmp_path / "fruit.txt").write_text("The fruit of the day is a mango.\n")
    (tmp_path / "b.md").write_text("# Notes\nNothing else.\n")
    rc = main(["generate", "--prompt", "What is the fruit of the day?", "--file", str(tmp_path / "fruit.txt"),
               "--file", str(tmp_path / "b.md"), "--max-tokens", "12", "--ctx", "512", "--json"])
    out = capsys.readouterr()
    assert rc == 0 and "2 file(s) whole" in out.err and "fits" in out.err
    assert "mango" in json.loads(out.out)["text"].lower()


def test_generate_retrieves_when_files_do_not_fit(capsys, tmp_path, tiny_gguf_path):
    lines = [f"Line {i}: the weather report says cloudy with light rain." for i in range(300)]
    lines[200] = "The fruit of the day is a mango."
    (tmp_path / "big.txt").write_text("\n".join(lines) + "\n")
    rc = main(["generate", "--prompt", "What is the fruit of the day?", "--file", str(tmp_path / "big.txt"),
               "--max-tokens", "8", "--ctx", "1024", "--json"])
    err = capsys.readouterr().err
    assert rc == 0 and "retrieved" in err and "big.txt:" in err
    start, end = map(int, err.split("big.txt:")[1].split()[0].rstrip(",").split("-"))
    assert start <= 201 <= end  # the passage holding line 201 went in


# -- models: library, check, rm, search, download ----------------------------------------------------------


@pytest.fixture
def library_home(tmp_path, monkeypatch):
    from hub_server import isolate

    return isolate(monkeypatch, tmp_path)


def test_models_lists_library_presets_and_folders(capsys, library_home, tmp_path):
    from gguf_files import write_gguf

    folder = tmp_path / "mine"
    write_gguf(folder / "mine.gguf", name="Mine")
    assert main(["models", "--json", "--add-dir", str(folder)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {r["preset"] for r in out["presets"]} >= {"tiny", "qwen-coder"}
    assert out["cpu"] and out["llama_weight_repack"].startswith("llama.cpp weight repack")
    by_name = {m["name"]: m for m in out["models"]}
    assert by_name["Mine"]["source"] == "folder" and by_name["Mine"]["complete"]
    assert by_name["SmolLM2-135M-Instruct-Q4_1"]["preset"] == "tiny"
    assert any(f["path"] == str(folder.resolve()) and f["remembered"] for f in out["folders"])
    assert main(["models", "list"]) == 0  # remembered: listed without --dir, as a table
    text = capsys.readouterr().out
    assert "mine" in text and "presets:" in text and "CPU:" in text


def test_models_check_exit_codes_and_reasons(capsys, tmp_path, tiny_gguf_path):
    from gguf_files import vocabulary, write_gguf

    assert main(["models", "check", "tiny", "tiny"]) == 0
    assert "compatible" in capsys.readouterr().out
    vocab = vocabulary(tiny_gguf_path)
    vocab["tokens"][1000] = "<|object_ref_start|>"
    crafted = write_gguf(tmp_path / "crafted.gguf", n_layer=1, n_embd=8, n_ff=16, **vocab)[0]
    assert main(["models", "check", "tiny", str(crafted), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["compatible"] is False and out["reasons"][0].startswith("token 1000 differs: draft '<|object_ref_start|>'")
    assert "greedy" in out["without_draft"]


def test_models_rm_asks_unless_yes(capsys, library_home, monkeypatch):
    from gguf_files import write_gguf

    parts = write_gguf(library_home["cache"] / "gone.gguf", split=2)
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    assert main(["models", "rm", str(parts[0])]) == 1  # no terminal to ask on, no --yes: nothing deleted
    assert "pass --yes" in capsys.readouterr().out and all(p.exists() for p in parts)
    size = sum(p.stat().st_size for p in parts)
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: "n")
    assert main(["models", "rm", str(parts[1])]) == 1 and all(p.exists() for p in parts)
    monkeypatch.setattr("builtins.input", lambda prompt: "y")
    assert main(["models", "rm", str(parts[1])]) == 0
    assert not any(p.exists() for p in parts) and "freed" in capsys.readouterr().out
    write_gguf(library_home["cache"] / "again.gguf")
    assert main(["models", "rm", str(library_home["cache"] / "again.gguf"), "--yes", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["deleted"] is True


def test_models_search_and_download_through_the_hub(capsys, library_home, monkeypatch, tmp_path):
    from gguf_files import write_gguf
    from hub_server import FakeHub

    data = write_gguf(tmp_path / "m.gguf", name="Hubbed")[0].read_bytes()
    with FakeHub() as fake:
        fake.add_repo("org/hubbed-GGUF", {"hubbed-Q8_0.gguf": data}, downloads=7)
        for k, v in fake.env().items():
            monkeypatch.setenv(k, v)
        assert main(["models", "search", "hubbed"]) == 0
        assert "org/hubbed-GGUF" in capsys.readouterr().out
        assert main(["models", "download", "org/hubbed-GGUF"]) == 0  # no file named: its files and fit
        listing = capsys.readouterr().out
        assert "Q8_0" in listing and "hubbed-Q8_0.gguf" in listing
        assert main(["models", "download", "org/hubbed-GGUF", "--quant", "Q8_0", "--json"]) == 0
        (path,) = json.loads(capsys.readouterr().out)["files"]
        assert open(path, "rb").read() == data
        assert main(["models", "download", "org/missing-GGUF"]) == 2
        assert "repo org/missing-GGUF not found" in capsys.readouterr().err
    assert main(["models", "--json"]) == 0
    assert any(m["repo"] == "org/hubbed-GGUF" for m in json.loads(capsys.readouterr().out)["models"])
