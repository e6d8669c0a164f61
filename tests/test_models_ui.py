"""The Models tab's handlers without a server: the load form (context, GPU layers, threads, backends) and its
plan, a load's stages, Cancel, failures that keep the old models, Unload; the library table, card and delete
with confirmation; the draft picker's reasons; Hugging Face search, files with fit badges and the download
queue against the stand-in Hub."""

from __future__ import annotations


import pytest

gr = pytest.importorskip("gradio")

from app.compare.store import ResultStore  # noqa: E402
from app.serve.ui.chat import ChatUI, Session  # noqa: E402
from app.serve.ui.compare import CompareUI  # noqa: E402
from app.serve.ui.models import NO_MODEL, SWITCH_NOTE, ModelsUI, describe_markdown  # noqa: E402
from app.storage import HistoryStore  # noqa: E402
from backends.base import BackendError  # noqa: E402
from backends.registry import ModelSpec  # noqa: E402
from backends.tokenizer import VocabMismatch  # noqa: E402
from fake_engine import FakeEngine  # noqa: E402
from ui_helpers import say, values as default_values  # noqa: E402

FORM = dict(target_backend="llamacpp", draft="", draft_backend="llamacpp", n_ctx=None, gpu_auto=True,
            gpu_layers=None, threads=None)


def form(target, **kw) -> tuple:
    f = FORM | kw
    return (target, f["target_backend"], f["draft"], f["draft_backend"], f["n_ctx"], f["gpu_auto"], f["gpu_layers"],
            f["threads"])


def run_load(ui: ModelsUI, *values) -> tuple[list, tuple]:
    """Drain the Load button's generator: (every progress html it drew, its last outputs)."""
    outs = list(ui.load(*values))
    return [o[0] for o in outs if isinstance(o[0], str)], outs[-1]


@pytest.fixture
def store(tmp_path) -> HistoryStore:
    return HistoryStore(tmp_path / "data")


# -- the load form -------------------------------------------------------------------------------------------
def test_load_form_sets_context_gpu_layers_threads_and_shows_stages(store):
    eng = FakeEngine(draft=False)
    eng.load_steps, eng.step_s = 4, 0.05
    ui, chat = ModelsUI(eng), ChatUI(eng, store)
    assert "fake-target" in ui.view().info and "No draft model" in ui.view().info
    drawn, (html, status, info, plan, _mem) = run_load(
        ui, *form(" org/big:model.gguf ", target_backend="pytorch", draft="small.gguf", n_ctx=1024, gpu_auto=False,
                  gpu_layers=12, threads=3))
    assert status.startswith("✓ Loaded target org/big:model.gguf (pytorch) + draft small.gguf (llamacpp), context")
    assert eng.specs == (ModelSpec("org/big:model.gguf", backend="pytorch", n_ctx=1024, n_gpu_layers=12, n_threads=3),
                         ModelSpec("small.gguf", n_ctx=1024, n_gpu_layers=12, n_threads=3))
    # the stages as they went: the target's bar while it loaded, then both done
    assert any('data-role="target"' in h and 'data-role="draft"' not in h for h in drawn)
    assert '"dsbd-stage dsbd-stage-done" data-stage="load" data-role="draft"' in html
    assert "dsbd-stage-now" not in html and "`small.gguf`" in info and "| Draft source |" in info
    # the next load keeps what the form leaves empty; auto GPU layers and 0 threads go back to the defaults
    _, (_, status, info, _, _) = run_load(ui, *form("tiny", threads=0))
    assert eng.specs == (ModelSpec("tiny", n_ctx=1024), None) and "No draft model" in info
    eng.tokenizer = type("Tok", (), {"decode": lambda self, ids: b"new"})()
    assert chat.decode([1]) == b"new"  # the chat tab follows the swapped tokenizer
    assert "--ctx" in SWITCH_NOTE and "--n-gpu-layers" in SWITCH_NOTE


@pytest.mark.parametrize("err", [VocabMismatch("token 42 differs: draft b'x' vs target b'y'"),
                                 BackendError("llama.cpp could not load bad.gguf"), RuntimeError("bug")])
def test_a_failed_load_names_its_cause_and_keeps_the_old_models(store, err):
    eng = FakeEngine()
    ui = ModelsUI(eng)
    before = ui.view().info
    eng.swap_fails_with = err
    _, (html, status, info, _, _) = run_load(ui, *form("other", draft="other-draft"))
    assert status.startswith("⚠️ Could not load: ") and str(err) in status
    assert "Still serving the previous models" in status
    assert ("draft of the target's model family" in status) == isinstance(err, VocabMismatch)
    assert info == before and "dsbd-stage-failed" in html
    assert say(ChatUI(eng, store), Session(), "still there?")[-1].status.startswith("Done")


def test_cancel_stops_a_running_load_and_the_old_models_keep_answering(store):
    eng = FakeEngine()
    eng.load_steps, eng.step_s = 200, 0.02  # 4 s per model unless cancelled
    ui = ModelsUI(eng)
    assert ui.cancel_load() == "Nothing to cancel: no load is running."
    gen = ui.load(*form("slow-target", draft="slow-draft"))
    first = next(gen)
    assert first[1].startswith("Loading…")
    again = list(ui.load(*form("another")))  # one load at a time
    assert again[-1][1].startswith("⚠️ Already loading slow-target")
    assert ui.cancel_load().startswith("Cancelling…")
    *_, (html, status, info, _, _) = gen
    assert status.startswith("■ Load cancelled (stopped ") and "s after Cancel" in status
    assert "cancelled while target: loading the weights" in status and "Still serving the previous models" in status
    assert 'dsbd-stage-cancelled" data-stage="load" data-role="target"' in html
    assert eng.names == ("fake-target", "fake-draft") and "fake-target" in info
    assert say(ChatUI(eng, store), Session(), "still there?")[-1].status.startswith("Done")


def test_form_errors_say_what_to_fix():
    eng = FakeEngine()
    ui = ModelsUI(eng)
    cases = {form("  "): "choose a target model",
             form("tiny", target_backend="onnx"): "unknown backend 'onnx'",
             form("tiny", gpu_auto=False, gpu_layers=2.5): "GPU layers must be a whole number",
             form("tiny", gpu_auto=False, gpu_layers=None): "GPU layers: enter a number",
             form("tiny", threads=-2): "threads must be a whole number >= 0",
             form("tiny", n_ctx=8): "context length must be a whole number >= 16"}
    for values, said in cases.items():
        status = list(ui.load(*values))[-1][1]
        assert status.startswith("⚠️") and said in status, (values, status)
        assert said in ui.form_plan(*values)
    assert eng.describe()["target"] == "fake-target"


def test_form_plan_follows_the_form(tiny_gguf_path, monkeypatch):
    import app.engine.engine
    from app.engine.planning import PlanError

    ui = ModelsUI(FakeEngine())
    path = str(tiny_gguf_path)
    text = ui.form_plan(*form(path, draft=path, n_ctx=2048))
    assert text.startswith("```text") and "2048" in text  # the real plan of the real file at this context
    assert "set by hand: 5" in ui.form_plan(*form(path, gpu_auto=False, gpu_layers=5))
    assert "once target `org/x:y.gguf` is on this machine" in ui.form_plan(*form("org/x:y.gguf"))

    def no_fit(*a, **k):
        raise PlanError("dsbd does not fit: use --ctx 512")
    monkeypatch.setattr(app.engine.engine, "memory_plan", no_fit)
    assert ui.form_plan(*form(path)) == "⚠️ This will not fit: dsbd does not fit: use --ctx 512"


def test_unload_draft_then_all_and_the_chat_says_what_to_do(store):
    eng = FakeEngine()
    ui, chat = ModelsUI(eng), ChatUI(eng, store)
    v = ui.unload("draft")
    assert v.status.startswith("Unloaded the draft") and "No draft model" in v.info
    v = ui.unload("all")
    assert v.info == NO_MODEL and "memory is free" in v.status and describe_markdown(eng) == NO_MODEL
    views = say(chat, Session(), "hello?")
    assert "no model is loaded" in views[-1].status and "Models tab" in views[-1].status
    assert ui.unload("all").status == "Nothing to unload: no model is loaded."
    compare = CompareUI(eng, ResultStore(store.root))
    said = list(compare.run(Session(), "hi", ["greedy", "sample"], True, "", *default_values(),
                            progress=lambda *a, **k: None))[-1][2]
    assert said.startswith("no model is loaded") and "Models tab" in said
    _, (_, status, info, _, _) = run_load(ui, *form("back"))  # loading again serves
    assert status.startswith("✓ Loaded target back") and say(chat, Session(), "hi")[-1].status.startswith("Done")


# -- library, card, delete, drafts ---------------------------------------------------------------------------
@pytest.fixture
def lib(monkeypatch, tmp_path):
    from hub_server import isolate

    return isolate(monkeypatch, tmp_path)


def test_library_table_card_and_delete_with_confirmation(lib, tiny_gguf_path):
    from gguf_files import write_gguf

    mine = write_gguf(lib["cache"] / "mine-F32.gguf", name="Mine", basename="Mine", size_label="1K")[0]
    eng = FakeEngine()
    ui = ModelsUI(eng)
    rows, summary, choices = ui.library(n_ctx=1024)
    row = next(r for r in rows if r[-1] == str(mine))
    assert row[1:5] == ["Mine", "llama", row[3], "F32"] and row[7].startswith('<span class="dsbd-fit dsbd-fit-')
    assert "model file(s)" in summary and (f"Mine · F32 · {row[6]}", str(mine)) in choices
    assert ("preset tiny", "tiny") in choices
    md, path = ui.card(row[0])
    assert path == str(mine) and "| architecture | `llama` |" in md and "general.name: Mine" in md
    text, ask = ui.delete_plan(path)
    assert ask and text.startswith("**Delete?**") and "frees" in text and str(mine) in text
    eng.specs = (ModelSpec(str(mine)), None)  # a loaded file is not deleted under the model
    text, ask = ui.delete_plan(path)
    assert not ask and "is loaded as the target" in text
    eng.specs = (None, None)
    status, rows, _, _ = ui.delete(path)
    assert status.startswith("Deleted: freed ") and not mine.exists() and all(r[-1] != str(mine) for r in rows)
    assert ui.delete_plan("")[0] == "Click a model in the library first."


def test_draft_picker_lists_compatible_files_first_and_says_why_others_are_refused(lib, tiny_gguf_path):
    import shutil

    from gguf_files import vocabulary, write_gguf

    small = lib["cache"] / "tiny-copy.gguf"
    shutil.copy(tiny_gguf_path, small)
    voc = vocabulary(tiny_gguf_path)
    voc["tokens"][100] = "<|different|>"
    write_gguf(lib["cache"] / "odd.gguf", name="Odd", **voc)
    odd = str(lib["cache"] / "odd.gguf")
    ui = ModelsUI(FakeEngine())
    choices, keep, notes = ui.drafts(str(tiny_gguf_path), "tiny")
    assert choices[0] == ("none (the target alone)", "")
    assert any(value == str(small) and label.startswith("✓ ") for label, value in choices[1:])
    assert all(value != odd for _, value in choices) and keep == str(tiny_gguf_path)  # the preset, by its file
    assert "**Odd**" in notes and "token 100 differs" in notes
    choices, keep, notes = ui.drafts(str(tiny_gguf_path), odd)  # a refused draft picked earlier is cleared
    assert keep == "" and "`Odd` was cleared: it cannot draft for this target (token 100 differs" in notes
    assert ui.drafts(str(tiny_gguf_path), "org/x:y.gguf")[1] == "org/x:y.gguf"  # a typed source stays
    choices, _, notes = ui.drafts(odd)  # only itself shares its vocabulary: what the app does without a draft
    assert [value for _, value in choices] == ["", odd] and "the target itself" in choices[1][0]
    assert "none speeds it up. Without a draft the target runs greedy, sample" in notes
    assert "sps" in notes.split("; ")[1] and "Hugging Face" in notes
    assert "appears once `org/x:y.gguf` is on this machine" in ui.drafts("org/x:y.gguf")[2]


# -- Hugging Face --------------------------------------------------------------------------------------------
def test_hub_search_files_download_and_cancel_with_confirmation(lib, monkeypatch):
    from gguf_files import write_gguf
    from hub_server import FakeHub

    from app.serve.ui.downloads import HubUI

    small = write_gguf(lib["cache"].parent / "src" / "m-Q8_0.gguf", name="M", basename="M")[0].read_bytes()
    with FakeHub() as hub:
        hub.add_repo("org/M-GGUF", {"m-Q8_0.gguf": small, "m-F32.gguf": small + b"\0" * 64}, downloads=5)
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        ui = HubUI(ModelsUI(FakeEngine()))
        try:
            rows, status = ui.search("M")
            assert rows[0][0] == "org/M-GGUF" and rows[0][2] == 5 and "Click one" in status
            rows, status = ui.files("org/M-GGUF", 1024)
            assert {r[0] for r in rows} == {"Q8_0", "F32"} and all(r[4] for r in rows) and "Fit badges" in status
            html, status = ui.download("org/M-GGUF", "m-Q8_0.gguf")
            assert status.startswith("Queued m-Q8_0.gguf") and 'data-job="org/M-GGUF:m-Q8_0.gguf"' in html
            assert ui.manager.wait("org/M-GGUF:m-Q8_0.gguf", timeout=60).state == "done"
            assert ui.done_count() == 1 and any(r[1] == "M" for r in ui.models.library()[0])

            hub.throttle_s = 0.05  # a slow one, to pause and cancel
            ui.download("org/M-GGUF", "m-F32.gguf")
            job = "org/M-GGUF:m-F32.gguf"
            assert ui.pause(job).startswith("Paused m-F32.gguf")
            text, ask = ui.cancel_plan(job)
            assert ask and text.startswith("**Cancel the download?** It deletes")
            assert ui.cancel(job).startswith("Cancelled m-F32.gguf") and job not in ui.job_ids()
            assert ui.cancel_plan("")[0] == "Pick a download first."
            assert ui.search("nothing-like-it")[1] == "No GGUF repo matches 'nothing-like-it'."
            # drafts of the target's family on the Hub, checked against it from a fetched header
            hub.add_repo("org/M-tiny-GGUF", {"m-tiny-Q8_0.gguf": small})
            odd = write_gguf(lib["cache"].parent / "src" / "odd-Q8_0.gguf", name="Odd", basename="M",
                             tokens=["<unk>", "<s>", "</s>", "x", "y"])[0].read_bytes()
            hub.add_repo("org/M-odd-GGUF", {"odd-Q8_0.gguf": odd})
            target = str(lib["cache"] / "hub" / "org" / "M-GGUF" / "m-Q8_0.gguf")
            rows, status = ui.family(target)
            verdicts = {r[0]: r[5] for r in rows}
            assert verdicts["org/M-tiny-GGUF"] == "✓ compatible" and verdicts["org/M-odd-GGUF"].startswith("✗ ")
            assert "of the M family" in status
            assert ui.family("")[1].startswith("Pick a target that is on this machine first")
        finally:
            ui.close()
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    rows, status = ui.search("M")
    assert rows == [] and status.startswith("⚠️") and "no network" in status.lower(), status
