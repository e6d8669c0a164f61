"""The target over two loopback RPC workers vs a local load: pass costs, bytes on the wire, tokens/s.

    python scripts/measure_rpc.py --preset tiny --out docs/measurements/rpc-tiny.json
    python scripts/measure_rpc.py --preset qwen-coder --out docs/measurements/rpc-qwen-coder.json
    python scripts/measure_rpc.py --project docs/measurements/rpc-tiny.json docs/measurements/rpc-qwen-coder.json \
        --out docs/measurements/rpc-projection.json

Workers are `dsbd-chat rpc-worker` processes on 127.0.0.1 (one thread each; the host uses one thread too).
Bytes are counted by a forwarding proxy in front of each worker, on a separate load (the proxy's own latency
stays out of the timings). Local and split models are loaded side by side and timed alternately (min pass
time, best round per answer): the machine is shared, so read the ratios, not the absolute speeds.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from _common import ROOT_DIR as ROOT, machine  # the repository (and tests/, for helpers) on sys.path

from app.config import DecodeParams  # noqa: E402
from backends.llamacpp import rpc  # noqa: E402
from backends.registry import ModelSpec  # noqa: E402
from helpers import free_port  # noqa: E402

FOREST_SIZES = (1, 4, 16, 64)
MODES = {"greedy": DecodeParams(mode="greedy"),
         "beam-sample": DecodeParams(mode="beam-sample", beams=4, top_k=20, seed=1),
         "dsbd": DecodeParams(mode="dsbd", beams=4, gamma=3, top_k=20, seed=1)}
PROMPTS = [[{"role": "user", "content": "Write a Python function that checks whether a number is prime."}],
           [{"role": "user", "content": "Explain in three sentences why the sky is blue."}]]


def start_worker() -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "rpc-worker", "--port", str(port), "--threads", "1"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ep = f"127.0.0.1:{port}"
    for _ in range(300):
        try:
            rpc.check(ep, timeout=1)
            return proc, ep
        except rpc.WorkerUnreachable:
            time.sleep(0.2)
    raise RuntimeError(f"worker {ep} did not start")


class Proxy:
    """127.0.0.1:port -> a worker, counting the bytes each way."""

    def __init__(self, target: str) -> None:
        self.host, self.port = rpc.split(target)
        self.sent = self.received = 0  # client -> worker, worker -> client
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            c, _ = self.sock.accept()
            u = socket.create_connection((self.host, self.port))
            for a, b, up in ((c, u, True), (u, c, False)):
                threading.Thread(target=self._pump, args=(a, b, up), daemon=True).start()

    def _pump(self, a, b, up: bool) -> None:
        try:
            while data := a.recv(1 << 16):
                if up:
                    self.sent += len(data)
                else:
                    self.received += len(data)
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def pass_bytes(path: Path, endpoints: list[str], threads: int) -> dict:
    """Bytes each way per evaluate() of a flat n-token forest after a 128-token prompt, over proxies."""
    from backends.base import ROOT as TREE_ROOT, Forest
    from backends.llamacpp.runtime import LlamaModel

    proxies = [Proxy(ep) for ep in endpoints]
    model = LlamaModel(path, n_threads=threads, extra_bufts="off", rpc=[p.endpoint for p in proxies],
                       n_gpu_layers=-1)
    out = {"load_sent_bytes": sum(p.sent for p in proxies)}
    vocab = model.info.vocab_size
    ids = [(i * 7919) % (vocab - 200) + 100 for i in range(128)]
    with model.context(rows=1, max_tokens=512) as ctx:
        ctx.prefill(ids)
        for n in FOREST_SIZES:
            rows = []
            for rep in range(3):
                s0, r0 = sum(p.sent for p in proxies), sum(p.received for p in proxies)
                ctx.evaluate(Forest(tokens=tuple(ids[(i * 13 + rep) % 128] for i in range(n)), parents=(TREE_ROOT,) * n,
                                    rows=(0,) * n))
                time.sleep(0.05)  # let the proxy threads count the tail
                rows.append((sum(p.sent for p in proxies) - s0, sum(p.received for p in proxies) - r0))
                ctx.truncate(len(ids))
            out[str(n)] = {"sent": min(r[0] for r in rows), "received": min(r[1] for r in rows)}
    # The attention mask each worker gets grows with the KV cells in use: n = 16 after longer prompts.
    out["by_prompt_n16"] = {}
    with model.context(rows=1, max_tokens=2048) as ctx:
        done = 0
        for length in (128, 512, 1024, 2000):
            more = [(i * 7919) % (vocab - 200) + 100 for i in range(done, length)]
            ctx.prefill(ids_all := (ctx.tokens(0) + more))
            done = len(ids_all)
            s0, r0 = sum(p.sent for p in proxies), sum(p.received for p in proxies)
            ctx.evaluate(Forest(tokens=tuple(ids[i] for i in range(16)), parents=(TREE_ROOT,) * 16, rows=(0,) * 16))
            time.sleep(0.05)
            out["by_prompt_n16"][str(length)] = {"sent": sum(p.sent for p in proxies) - s0,
                                                 "received": sum(p.received for p in proxies) - r0}
            ctx.truncate(done)
    out["n_embd"] = model.info.extra["n_embd"]
    out["vocab"] = vocab
    out["placement"] = model.info.extra["placement"]
    model.close()
    return out


def pass_costs(path: Path, endpoints: list[str], threads: int, rounds: int) -> dict:
    """Min seconds of one flat n-token forest pass, local and split, measured alternately (a shared machine)."""
    from app.engine.timing import measure_costs
    from backends.llamacpp.runtime import LlamaModel

    models = {"local": LlamaModel(path, n_threads=threads, extra_bufts="off"),
              "rpc": LlamaModel(path, n_threads=threads, extra_bufts="off", rpc=endpoints, n_gpu_layers=-1)}
    best: dict[str, dict[str, float]] = {k: {} for k in models}
    try:
        for _ in range(rounds):
            for k, m in models.items():
                for n, sec in measure_costs(m, FOREST_SIZES, repeats=2).items():
                    best[k][str(n)] = min(sec, best[k].get(str(n), float("inf")))
    finally:
        for m in models.values():
            m.close()
    return best


def answers(spec: ModelSpec, endpoints: list[str], max_new: int, rounds: int) -> dict:
    """tokens/s per mode, local and split, alternating answer by answer; the best round per prompt."""
    from app.engine.engine import Engine, final_event

    engines = {"local": Engine.load(spec, spec), "rpc": Engine.load(replace(spec, rpc=tuple(endpoints)), spec)}
    out = {k: {} for k in engines}
    try:
        for e in engines.values():  # warm-up
            final_event(e.generate(e.encode(PROMPTS[0]), replace(MODES["greedy"], max_new_tokens=4)))
        for name, params in MODES.items():
            for k in engines:
                out[k][name] = {"runs": [None] * len(PROMPTS)}
            for _ in range(rounds):
                for i, messages in enumerate(PROMPTS):
                    for k, e in engines.items():
                        st = final_event(e.chat(messages, replace(params, max_new_tokens=max_new))).stats
                        run = {"tokens": st["new_tokens"], "tokens_per_s": st["tokens_per_s"],
                               "target_passes": st.get("target_passes")}
                        have = out[k][name]["runs"][i]
                        if have is None or run["tokens_per_s"] > have["tokens_per_s"]:
                            out[k][name]["runs"][i] = run
            for k in engines:
                runs = out[k][name]["runs"]
                secs = sum(r["tokens"] / r["tokens_per_s"] for r in runs)
                out[k][name]["tokens_per_s"] = sum(r["tokens"] for r in runs) / secs
    finally:
        for e in engines.values():
            e.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds; the best one counts")
    ap.add_argument("--bytes-only", action="store_true", help="only the bytes per pass (no timings)")
    ap.add_argument("--project", nargs="+", metavar="JSON", help="write the 7B / 70B projection from these runs")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.project:
        out = project([json.loads(Path(f).read_text()) for f in a.project])
        Path(a.out).write_text(json.dumps(out, indent=1))
        print(json.dumps(out, indent=1))
        return 0
    from backends.modelfiles.resolution import resolve

    path = resolve(a.preset, role="target").path
    procs = [start_worker() for _ in range(2)]
    eps = [ep for _, ep in procs]
    try:
        result = {"machine": machine(), "preset": a.preset, "threads": a.threads, "max_new_tokens": a.max_tokens, "rounds": a.rounds,
                  "workers": eps, "load_average": list(__import__("os").getloadavg())}
        result["bytes_per_pass"] = pass_bytes(path, eps, a.threads)
        if a.bytes_only:
            Path(a.out).write_text(json.dumps(result, indent=1))
            print(json.dumps(result, indent=1))
            return 0
        result["pass_cost_s"] = pass_costs(path, eps, a.threads, a.rounds)
        spec = ModelSpec(source=a.preset, n_threads=a.threads, n_ctx=1024, llama_extra_bufts="off")
        result["answers"] = answers(spec, eps, a.max_tokens, a.rounds)
    finally:
        for p, _ in procs:
            p.kill()
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


# ---------------------------------------------------------------- projection from the measured bytes

TARGETS = {"7B": {"n_embd": 4096, "weights_gb": 4.4}, "70B": {"n_embd": 8192, "weights_gb": 42.5}}  # Q4_K_M
LINKS = {"1 GbE": {"mb_s": 117.0, "rtt_ms": 0.2}, "10 GbE": {"mb_s": 1170.0, "rtt_ms": 0.05}}
COMPUTE_GB_S = {"CPU workers (40 GB/s each)": 40.0, "GPU workers (900 GB/s each)": 900.0}
DRAFT_GB = 0.5  # a 0.5B draft (the qwen-coder pair's), read once per draft pass
FOREST_TOKENS = {"greedy": 1, "beam-sample W=4": 4, "dsbd W=4 W_S=5 gamma=3": 4 + 5 * 3}


def project(measured: list[dict], *, workers: int = 2, context: int = 4096, round_trips: int = 3) -> dict:
    """Network time per target pass for a 7B and a 70B target: per token and worker, the hidden state both ways
    (4 x n_embd bytes each) plus the other inputs, whose size the runs give per KV cell of the cache."""
    per_cell = []
    for m in measured:
        b = m["bytes_per_pass"]
        n_embd = b["n_embd"]
        big = b["by_prompt_n16"]["128"]["sent"]  # a 2048-cell cache, n = 16
        fixed = b["1"]["sent"] - (b["4"]["sent"] - b["1"]["sent"]) / 3
        per_token_worker = ((big - fixed) / 16 - 2 * 4 * n_embd) / 2
        per_cell.append(per_token_worker / 2048)
    other = max(per_cell) * context  # bytes per token per worker besides the hidden state
    runs = [r for m in measured if m.get("preset") == "qwen-coder" for r in m["answers"]["local"]["dsbd"]["runs"]]
    tau = {"greedy": 1.0, "beam-sample W=4": 1.0,
           "dsbd W=4 W_S=5 gamma=3": sum(r["tokens"] for r in runs) / sum(r["target_passes"] for r in runs)}
    out = {"assumptions": {"workers": workers, "context_cells": context, "round_trips_per_worker_per_pass": round_trips,
                           "other_input_bytes_per_cell": max(per_cell), "links": LINKS, "compute": COMPUTE_GB_S,
                           "tokens_per_target_pass": tau, "draft_gb": DRAFT_GB},
           "rows": []}
    for name, t in TARGETS.items():
        for mode, n in FOREST_TOKENS.items():
            bytes_pass = n * workers * (2 * 4 * t["n_embd"] + other) + 4122
            for link, l in LINKS.items():
                net_ms = bytes_pass / (l["mb_s"] * 1e6) * 1e3 + workers * round_trips * l["rtt_ms"]
                row = {"target": name, "mode": mode, "tokens_per_pass": n, "bytes_per_pass": int(bytes_pass),
                       "link": link, "network_ms_per_pass": round(net_ms, 2)}
                for hw, gb_s in COMPUTE_GB_S.items():
                    compute_ms = t["weights_gb"] / gb_s * 1e3  # memory-bound: every weight read once per pass
                    row[f"share of the pass, {hw}"] = round(net_ms / (net_ms + compute_ms), 3)
                    # tokens per target pass as measured (dsbd: the qwen-coder pair's acceptance) and the local
                    # draft's passes (0.5 GB read per pass on the host at the same speed)
                    drafts_ms = (DRAFT_GB / gb_s * 1e3 * 3) if mode.startswith("dsbd") else 0.0
                    row[f"tokens/s, {hw}"] = round(tau[mode] / ((compute_ms + drafts_ms + net_ms) / 1e3), 2)
                    row[f"tokens/s without network, {hw}"] = round(tau[mode] / ((compute_ms + drafts_ms) / 1e3), 2)
                out["rows"].append(row)
    return out


if __name__ == "__main__":
    sys.exit(main())
