"""llama.cpp RPC scale-out: the target split over the host CPU and RPC workers started here on 127.0.0.1.

Workers are `dsbd-chat rpc-worker` processes on free ports with one thread; each one exits by itself when the
test process goes away or after WORKER_LIFETIME_S. Equivalence runs on the random float32 llama of
test_llamacpp (the same tolerance), the end-to-end paths on the real `tiny` preset.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

from app.config import DecodeParams
from backends.base import BackendError
from backends.llamacpp import rpc
from backends.registry import ModelSpec, SpecError
from helpers import free_port

ROOT_DIR = Path(__file__).resolve().parent.parent
WORKER_LIFETIME_S = 900
HI = [{"role": "user", "content": "Say hello in five words."}]
LONG = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]

needs_rpc = pytest.mark.skipif(not rpc.supported(), reason="llama-cpp-python built without GGML_RPC "
                                                           f"(rebuild: {rpc.REBUILD})")

# A worker that ends itself: when its parent (the test run) is gone, or after WORKER_LIFETIME_S.
_WORKER = textwrap.dedent("""
    import os, sys, threading, time
    parent, deadline = os.getppid(), time.monotonic() + float(sys.argv[2])
    def watch():
        while os.getppid() == parent and time.monotonic() < deadline:
            time.sleep(0.5)
        os._exit(0)
    threading.Thread(target=watch, daemon=True).start()
    from app.cli import main
    sys.exit(main(["rpc-worker", "--port", sys.argv[1], "--threads", "1", *sys.argv[3:]]))
""")


class Worker:
    """One rpc-worker subprocess on 127.0.0.1:port."""

    def __init__(self, port: int | None = None, *extra: str) -> None:
        self.port = port or free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(self.port), str(WORKER_LIFETIME_S), *extra],
                                     cwd=ROOT_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while True:
            try:
                rpc.check(self.endpoint, timeout=1.0)
                return
            except rpc.WorkerUnreachable:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    out, err = self.proc.communicate(timeout=5)
                    raise RuntimeError(f"rpc-worker on {self.endpoint} did not start: {err[-2000:]}")
                time.sleep(0.2)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def restart(self) -> "Worker":
        self.kill()
        return Worker(self.port)


@pytest.fixture(scope="module")
def workers():
    if not rpc.supported():
        pytest.skip("llama-cpp-python built without GGML_RPC")
    ws = [Worker(), Worker()]
    yield ws
    for w in ws:
        w.kill()


# -- endpoints and checks (no native library) ------------------------------------------------------------
def test_endpoints_are_parsed_normalised_and_checked():
    assert rpc.parse_endpoints(" 10.0.0.2:50052, host-b.lan:1 ,[fd00::2]:7") == \
        ("10.0.0.2:50052", "host-b.lan:1", "[fd00::2]:7")
    assert rpc.parse_endpoints(None) == () and rpc.parse_endpoints("") == ()
    for bad, why in [("10.0.0.2", "HOST:PORT"), ("h:0", "between 1 and 65535"), ("h:99999", "between 1"),
                     ("fd00::2:5", "HOST:PORT"), ("a b:5", "not a host name")]:
        with pytest.raises(rpc.RPCError, match=why):
            rpc.parse_endpoints(bad)
    with pytest.raises(rpc.RPCError, match="listed twice"):
        rpc.parse_endpoints("a:1,a:1")
    assert rpc.is_loopback("127.0.0.1") and rpc.is_loopback("::1") and rpc.is_loopback("localhost")
    assert not rpc.is_loopback("0.0.0.0") and not rpc.is_loopback("192.168.1.20")
    with pytest.raises(SpecError, match="llamacpp"):
        ModelSpec(source="x", backend="pytorch", rpc=("a:1",)).validated()
    with pytest.raises(SpecError, match="tuple of HOST:PORT"):
        ModelSpec(source="x", rpc=("a:1 ",)).validated()


def test_a_refused_port_is_a_clear_error_not_an_abort(tmp_path):
    port = free_port()  # nothing listens there
    with pytest.raises(rpc.WorkerUnreachable, match=f"127.0.0.1:{port} is not usable: connection refused"):
        rpc.check(f"127.0.0.1:{port}")
    # The whole CLI path, in a child so that an abort would show as a signal rather than end this run.
    r = subprocess.run([sys.executable, "-m", "app.cli", "generate", "--rpc", f"127.0.0.1:{port}", "--prompt", "hi",
                        "--max-tokens", "2", "--llama-extra-bufts", "off", "--threads", "1"],
                       cwd=ROOT_DIR, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"dsbd-chat: error: the RPC worker 127.0.0.1:{port} is not usable: connection refused")
    assert "dsbd-chat rpc-worker" in last


def test_a_silent_listener_times_out_with_the_busy_hint():
    with socket.socket() as s:  # accepts TCP connections (backlog) but never answers the hello
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        ep = f"127.0.0.1:{s.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(rpc.WorkerUnreachable, match="no handshake in 0.5 s .*one client at a time"):
            rpc.check(ep, timeout=0.5)
        assert time.monotonic() - t0 < 5


@needs_rpc
def test_the_worker_warns_off_loopback_and_not_on_it():
    def start(host: str) -> tuple[str, int | None]:
        """(what the worker printed until it served, its exit status after Ctrl+C)."""
        proc = subprocess.Popen([sys.executable, "-c", _WORKER, str(free_port()), "60", "--host", host],
                                cwd=ROOT_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            err = ""
            deadline = time.monotonic() + 60
            while "Ctrl+C stops it" not in err and time.monotonic() < deadline:
                err += proc.stderr.readline()
            proc.send_signal(signal.SIGINT)  # Ctrl+C stops it
            try:
                return err, proc.wait(20)
            except subprocess.TimeoutExpired:
                return err, None
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

    # Ctrl+C stops it, on any address, by the signal: the worker takes the default action before it says so
    stopped = (-signal.SIGINT,)
    err, rc = start("0.0.0.0")
    assert "warning: serving on 0.0.0.0: the RPC protocol has no authentication" in err
    assert "SSH tunnel" in err and "VPN" in err
    assert rc in stopped, rc
    err, rc = start("127.0.0.1")
    assert "warning" not in err and "Ctrl+C stops it" in err
    assert rc in stopped, rc


@needs_rpc
def test_ctrl_c_stops_a_worker():
    w = Worker()
    w.proc.send_signal(signal.SIGINT)
    assert w.proc.wait(20) == -signal.SIGINT
    with pytest.raises(rpc.WorkerUnreachable, match="connection refused"):
        rpc.check(w.endpoint)


# -- the split model equals the local one ------------------------------------------------------------------
@pytest.fixture(scope="module")
def random_gguf(tmp_path_factory):
    from llama_helpers import write_random_llama

    return write_random_llama(tmp_path_factory.mktemp("rpc") / "random.gguf", n_layer=3)


def test_a_split_float32_model_gives_the_local_forest_logits(workers, random_gguf):
    from llama_helpers import Tree, check_logits, deepest, iterate, make_oracle, rows_of, three_rows

    from backends.base import AcceptedPath
    from backends.llamacpp.runtime import LlamaModel

    eps = [w.endpoint for w in workers]
    local = LlamaModel(random_gguf, n_threads=1, extra_bufts="off")
    split = LlamaModel(random_gguf, n_threads=1, extra_bufts="off", rpc=eps, n_gpu_layers=2)
    oracle = make_oracle(local)  # from-scratch logits of the local load
    try:
        where = split.info.extra["placement"]
        # layer 0 on the host CPU, the other two on the workers, the output head pinned to the host
        assert where.startswith("layer 0 on the host CPU") and where.endswith("output head on the host CPU")
        assert all(ep in where for ep in eps), where
        assert set(split.info.extra["buffers_mib"]) == {"host CPU", *eps}
        vocab = split.info.vocab_size
        for seed in range(3):
            with three_rows(split) as ctx:  # rows, forest, commit and the next step, all on the split model
                tree = Tree(rows_of(ctx), seed, vocab=vocab)
                ids = list(range(len(tree.tokens)))
                check_logits(ctx.evaluate(tree.forest(ids, with_suffix=True)), tree, ids, oracle, roots=True)
            with three_rows(split) as ctx:
                iterate(ctx, oracle, 10 + seed,
                        lambda t: [AcceptedPath(0, deepest(t, 0)), AcceptedPath(1, deepest(t, 1)[:1]),
                                   AcceptedPath(2)], vocab)
    finally:
        oracle.close()
        split.close()
        local.close()


def test_a_split_float32_model_gives_the_local_greedy_answer(workers, random_gguf):
    from app.engine.engine import Engine

    spec = ModelSpec(source=str(random_gguf), n_threads=1, n_ctx=256, llama_extra_bufts="off")
    params = DecodeParams(mode="greedy", max_new_tokens=24)
    with_rpc = Engine.load(replace(spec, rpc=tuple(w.endpoint for w in workers)))
    local = Engine.load(spec)
    try:
        from app.engine.engine import final_event

        prompt = [1, 5, 200, 17, 42, 99]
        a, b = final_event(with_rpc.generate(prompt, params)), final_event(local.generate(prompt, params))
        assert a.tokens == b.tokens == 24 and a.text == b.text
        assert "RPC" in with_rpc.describe()["target_placement"]
    finally:
        with_rpc.close()
        local.close()


# -- the real tiny model in the supervised model process ---------------------------------------------------
TINY = ModelSpec(source="tiny", n_ctx=512, llama_extra_bufts="off", n_threads=1)


def test_dsbd_on_tiny_over_two_workers_answers(workers, tiny_gguf_path):
    from app.engine.worker import WorkerEngine

    target = replace(TINY, rpc=tuple(w.endpoint for w in workers))
    with WorkerEngine.load(target, TINY) as engine:
        info = engine.describe()
        assert all(w.endpoint in info["target_placement"] for w in workers), info
        assert info["target_placement"].endswith("output head on the host CPU")
        assert info["draft_placement"] == "this machine"
        last = list(engine.chat(HI, DecodeParams(mode="dsbd", beams=2, gamma=2, max_new_tokens=12, seed=1)))[-1]
        assert last.done and last.tokens > 0 and last.stats["mode"] == "dsbd" and last.text.strip()
        assert last.stats["target_passes"] >= 1


def test_a_killed_worker_ends_one_answer_and_the_next_answer_follows_its_restart(tiny_gguf_path):
    from app.engine.worker import WorkerEngine

    if not rpc.supported():
        pytest.skip("llama-cpp-python built without GGML_RPC")
    a, b = Worker(), Worker()
    try:
        target = replace(TINY, rpc=(a.endpoint, b.endpoint))
        with WorkerEngine.load(target) as engine:
            pid = engine.pid
            got = []
            with pytest.raises(BackendError) as err:
                for ev in engine.chat(LONG, DecodeParams(mode="greedy", max_new_tokens=300)):
                    got.append(ev)
                    if len(got) == 2:
                        b.kill()
            msg = str(err.value)
            assert msg.startswith(f"lost the RPC worker {b.endpoint} (connection refused") and len(got) < 300
            assert msg.endswith("(restarting; check the worker)")
            # While it is down every request says so at once, naming it; nothing hangs or loops.
            t0 = time.monotonic()
            with pytest.raises(BackendError, match=f"the RPC worker {b.endpoint} is down .*start it again"):
                list(engine.chat(HI, DecodeParams(mode="greedy", max_new_tokens=4)))
            assert time.monotonic() - t0 < 30
            b = b.restart()
            last = list(engine.chat(HI, DecodeParams(mode="greedy", max_new_tokens=8)))[-1]
            assert last.done and last.tokens > 0 and engine.pid != pid
            assert b.endpoint in engine.describe()["target_placement"]
    finally:
        a.kill()
        b.kill()


# -- the command line ------------------------------------------------------------------------------------
def test_cli_rejects_what_cannot_work_before_loading(capsys, workers):
    from app.cli import main

    ep = workers[0].endpoint
    assert main(["chat", "--no-browser", "--rpc", ep, "--no-worker"]) == 2
    assert "--rpc needs the supervised model process" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--rpc", "localhost"]) == 2
    assert "must be HOST:PORT" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--rpc", ep, "--target-backend", "pytorch"]) == 2
    assert "use --target-backend llamacpp" in capsys.readouterr().err


def test_compare_over_rpc_outlives_a_killed_worker(tmp_path, capsys, monkeypatch, tiny_gguf_path):
    """`compare --rpc` runs the target in the supervised model process, as generate and bench do: a worker lost
    mid-run ends the answers that needed it (saved as errors naming the worker), never the command (in this
    process the native RPC client would abort it, and this test run with it)."""
    from app.cli import main
    from app.compare import runner
    from app.compare.store import ResultStore

    if not rpc.supported():
        pytest.skip("llama-cpp-python built without GGML_RPC")
    a, b = Worker(), Worker()
    answer, answers = runner.generate_answer, []

    def kill_before_the_second_item(engine, *args, **kwargs):
        answers.append(engine)
        if len(answers) == 3:  # item 1 answered by both modes; item 2 meets a dead worker
            b.kill()
        return answer(engine, *args, **kwargs)

    monkeypatch.setattr(runner, "generate_answer", kill_before_the_second_item)
    try:
        code = main(["compare", "--target", "tiny", "--rpc", f"{a.endpoint},{b.endpoint}", "--ctx", "512",
                     "--threads", "1", "--llama-extra-bufts", "off", "--modes", "greedy,sample", "--prompts", "2",
                     "--max-tokens", "6", "--seed", "1", "--data-dir", str(tmp_path), "--json"])
    finally:
        a.kill()
        b.kill()
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and (out["state"], out["done"]) == ("done", 2)
    assert type(answers[0]).__name__ == "WorkerEngine"
    assert {m: (s["answers"], s["errors"]) for m, s in out["summary"].items()} == {"greedy": (2, 1), "sample": (2, 1)}
    errors = [x["error"] for r in ResultStore(tmp_path).list() for x in r["answers"] if x["error"]]
    assert len(errors) == 2 and all(b.endpoint in e for e in errors), errors


def test_plan_and_models_show_each_machines_part(capsys, workers, random_gguf):
    from app.cli import main

    eps = [w.endpoint for w in workers]
    assert main(["plan", "--target", str(random_gguf), "--rpc", ",".join(eps), "--vram", "0", "--context", "256"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("per machine"):].splitlines()
    assert table[2].startswith("this machine") and table[2].split()[2] == "-"  # no layer here, only the head
    assert [line.split()[0] for line in table[3:5]] == eps
    assert [line.split()[2] for line in table[3:5]] == ["0-1", "2-2"]  # 3 layers by free memory, head slot last
    assert main(["models", "--rpc", ",".join(eps)]) == 0
    out = capsys.readouterr().out
    assert "with --rpc: target layers on " + eps[0] in out and "the draft on this machine" in out


def test_without_rpc_support_the_error_says_how_to_rebuild(capsys, monkeypatch):
    from app.cli import main

    monkeypatch.setattr(rpc, "supported", lambda: False)
    for argv in (["generate", "--prompt", "x", "--rpc", "127.0.0.1:50052"], ["rpc-worker"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "built without RPC support" in err
        assert 'CMAKE_ARGS="-DGGML_RPC=on" pip install --no-cache-dir --force-reinstall --no-deps' in err


def test_the_models_tab_keeps_the_workers_for_the_target_only():
    pytest.importorskip("gradio")
    from types import SimpleNamespace

    from app.serve.ui.models import ModelsUI

    served = replace(TINY, rpc=("10.0.0.2:50052", "10.0.0.3:50052"))
    ui = ModelsUI(SimpleNamespace(specs=(served, None), n_ctx=512))
    target, draft = ui.specs_from("qwen-coder", "llamacpp", "tiny", "llamacpp")
    assert target.rpc == served.rpc and target.source == "qwen-coder"  # set by --rpc, not by the form
    assert draft.rpc == () and draft.source == "tiny"


def test_the_per_machine_plan_splits_like_the_loader_and_keeps_the_head_here():
    from offload_helpers import synthetic

    from offload.plan import GiB, MiB, plan_hosts

    geo = synthetic(n_layers=10, layer=100 * MiB)
    kv_layer = 2 * 2 * 64 * 4 * 512  # K and V, 2 kv heads x 64, f32, one row of 512 tokens
    # free memory 1:3: llama.cpp's proportional split, the last device also taking the output layer's slot
    shares = plan_hosts(geo, [("a:1 RPC0", 8 * GiB), ("b:1 RPC1", 24 * GiB)], context=512, rows=1,
                        host_free=4 * GiB, draft_bytes=300 * MiB)
    here, a, b = shares
    assert (here.first_layer, a.first_layer, a.last_layer, b.first_layer, b.last_layer) == (None, 0, 2, 3, 9)
    assert here.weight_bytes == 100 * MiB and here.kv_bytes == 0  # embeddings + head only
    assert (a.weight_bytes, b.weight_bytes) == (300 * MiB, 700 * MiB)
    assert (a.kv_bytes, b.kv_bytes) == (3 * kv_layer, 7 * kv_layer)
    assert here.need_bytes > here.weight_bytes + 300 * MiB and all(s.fits for s in shares)
    # keeping 4 layers here: the workers share the other 6
    here, a, b = plan_hosts(geo, [("a", 8 * GiB), ("b", 8 * GiB)], context=512, rows=1, host_free=GiB,
                            host_layers=4)
    assert (here.first_layer, here.last_layer, a.first_layer, b.last_layer) == (0, 3, 4, 9)
    assert a.weight_bytes + b.weight_bytes == 600 * MiB and here.weight_bytes == 500 * MiB and here.fits


def test_a_worker_restarted_between_answers_costs_one_answer(tiny_gguf_path):
    from app.engine.worker import WorkerEngine

    if not rpc.supported():
        pytest.skip("llama-cpp-python built without GGML_RPC")
    a, b = Worker(), Worker()
    try:
        with WorkerEngine.load(replace(TINY, rpc=(a.endpoint, b.endpoint))) as engine:
            assert list(engine.chat(HI, DecodeParams(mode="greedy", max_new_tokens=4)))[-1].done
            b = b.restart()  # its weights and the model process's connection are gone, the port answers again
            with pytest.raises(BackendError) as err:
                list(engine.chat(HI, DecodeParams(mode="greedy", max_new_tokens=4)))
            msg = str(err.value)
            assert msg.startswith(f"lost the RPC worker at one of {a.endpoint}, {b.endpoint} (its connection broke")
            assert msg.endswith("(restarting; check the worker)")
            assert list(engine.chat(HI, DecodeParams(mode="greedy", max_new_tokens=4)))[-1].done
    finally:
        a.kill()
        b.kill()
