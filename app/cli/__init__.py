"""`dsbd-chat` and its subcommands: chat (the browser UI and the API, the default), generate, bench, compare,
models (app/cli/models.py), plan and rpc-worker. This package holds the only argument parsers."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from app.cli.models import add_models_parser, cmd_models
from app.config import ACCEPTANCE_PRIOR, KNOBS, MODES, WARP, ConfigError, DecodeParams
from app.engine.timing import TIMED, cost_profile, profile_names
from backends.host import keep_freed_rows, rpc_endpoints
from backends.registry import BACKENDS, DTYPES, ModelSpec

PRESET_DEFAULT = "tiny"


def _model_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("models")
    g.add_argument("--preset", default=PRESET_DEFAULT, help="model preset: tiny | qwen-coder (default: tiny)")
    g.add_argument("--target", help="target model: preset, local .gguf, safetensors folder, or org/name[:file.gguf]")
    g.add_argument("--draft", help="draft model (same forms as --target); defaults to the preset's draft")
    g.add_argument("--target-backend", choices=BACKENDS, default="llamacpp")
    g.add_argument("--draft-backend", choices=BACKENDS, default="llamacpp")
    g.add_argument("--draft-quant", choices=("q4_0", "q4_0-head", "q8_0", "q4_k_m"), default=None,
                   help="run the draft from a requantized copy (made once, cached beside the original): q4_0-head "
                        "(Q4_0, vocabulary head too) made qwen-coder's draft passes 5-23%% cheaper at 2%% lower "
                        "sum(min(p, q)); see docs/measurements/draft-cost.md")
    g.add_argument("--dtype", choices=DTYPES, default="float32", help="pytorch runtime dtype")
    g.add_argument("--device", default="cpu", help="pytorch runtime device: cpu | cuda | cuda:N")
    g.add_argument("--threads", type=int, default=None,
                   help="llama.cpp threads (default: auto, up to the physical cores and one fewer for each core "
                        "other programs keep busy; a number pins it)")
    g.add_argument("--n-gpu-layers", type=int, default=None,
                   help="llama.cpp layers on the GPU (-1 = all; default: from the memory plan)")
    g.add_argument("--ctx", type=int, default=4096, help="context window in tokens (prompt + answer + draft tree)")
    g.add_argument("--rpc", default=None, metavar="HOST:PORT[,HOST:PORT...]",
                   help="spread the target's layers over llama.cpp RPC workers (started there with `dsbd-chat "
                        "rpc-worker`); the output head and the draft stay on this machine; --n-gpu-layers then "
                        "counts the layers on the workers (default: all)")
    _knob(g, "cost_profile", default=TIMED, metavar="NAME",
          extra=f"; one of {', '.join(profile_names())} (rtx4090-*: curves from published llama.cpp figures; the "
                "others: datasheets, priced per placement), or a curves .json file")
    g.add_argument("--llama-extra-bufts", choices=("auto", "on", "off"), default="auto",
                   help="llama.cpp weight repack (AMX and others); auto: $DSBD_CHAT_LLAMA_EXTRA_BUFTS, else a "
                        "cached one-time probe that turns it off where it crashes (AMX CPUs)")


def _knob(g, field: str, *, extra: str = "", **kw) -> None:
    """A setting's flag, its help the meaning app.config.KNOBS states (and `extra`, what only the CLI knows)."""
    k = KNOBS[field]
    g.add_argument(k.flag, help=(k.help + extra).replace("%", "%%"), **({"choices": k.choices} if k.choices else {}),
                   **kw)


def _decode_args(ap: argparse.ArgumentParser) -> None:
    d = DecodeParams()  # the defaults live in the dataclass; the API and the UI read them too
    g = ap.add_argument_group("decoding")
    g.add_argument("--mode", choices=MODES, default=d.mode,
                   help="auto: the fastest setting of --quality, from timed passes and measured acceptance")
    for field, kind in (("quality", str), ("max_new_tokens", int), ("temperature", float), ("top_k", int),
                        ("top_p", float), ("beams", int), ("draft_beams", int), ("gamma", int), ("threshold", float),
                        ("min_beams", int), ("select", str), ("forest", str), ("replacement", str),
                        ("lookup_nodes", int), ("length_penalty", float), ("seed", int)):
        _knob(g, field, type=kind, default=getattr(d, field))
    _knob(g, "lookup_sources", default=",".join(d.lookup_sources), metavar="SOURCE[,SOURCE...]")
    _knob(g, "stop", action="append", default=[])
    _knob(g, "unique_paths", dest="unique_paths", action="store_false")


def _given_warp(a) -> tuple[str, ...]:
    """The warp settings the command line gave; the others take DecodeParams' defaults. Bench and compare parse
    them with no default, so that a preset mode keeps the law the user asked for."""
    d = DecodeParams()
    given = tuple(f for f in WARP if getattr(a, f) is not None)
    for f in WARP:
        if getattr(a, f) is None:
            setattr(a, f, getattr(d, f))
    return given


def _params(a, *, validate: bool = True) -> DecodeParams:
    p = DecodeParams(mode=a.mode, max_new_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k,
                     top_p=a.top_p, beams=a.beams, draft_beams=a.draft_beams, gamma=a.gamma,
                     threshold=a.threshold, min_beams=a.min_beams, select=a.select,
                     length_penalty=a.length_penalty, seed=a.seed, stop=tuple(a.stop), quality=a.quality,
                     forest=a.forest, unique_paths=a.unique_paths, replacement=a.replacement,
                     lookup_nodes=a.lookup_nodes,
                     lookup_sources=tuple(x.strip() for x in a.lookup_sources.split(",") if x.strip()))
    return p.validated() if validate else p


def _specs(a, *, need_draft: bool) -> tuple[ModelSpec, ModelSpec | None]:
    common = dict(dtype=a.dtype, device=a.device, n_threads=a.threads, n_gpu_layers=a.n_gpu_layers, n_ctx=a.ctx,
                  llama_extra_bufts=a.llama_extra_bufts)
    target = ModelSpec(source=a.target or a.preset, backend=a.target_backend, rpc=rpc_endpoints(a.rpc),
                       **common).validated()  # only the target goes to RPC workers: the draft stays local
    draft_src = a.draft or (a.preset if not a.target else None)
    if need_draft and draft_src is None:
        raise ConfigError("this mode needs a draft model: pass --draft (a small model sharing the target's vocabulary)")
    draft = ModelSpec(source=draft_src, backend=a.draft_backend, quant=a.draft_quant,
                      **common).validated() if draft_src else None
    return target, draft


def _profile(a) -> str:
    """--cost-profile, checked: a name it does not know fails before any model loads."""
    try:
        cost_profile(a.cost_profile)
    except ValueError as e:
        raise ConfigError(str(e), field="cost_profile") from e
    return a.cost_profile


def open_engine(target: ModelSpec, draft: ModelSpec | None, *, supervised: bool = False, profile: str = TIMED):
    """The engine every command runs on: in a supervised model process when asked (the chat server: a native
    crash ends one answer, not the server) and always when the target's layers live on RPC workers (the native
    RPC client aborts its process when a worker goes away: a lost worker then ends the answers that needed it,
    never the command); otherwise in this process. `profile`: the cost profile adaptive forests are priced with."""
    if supervised or target.rpc:
        from app.engine.worker import WorkerEngine

        return WorkerEngine.load(target, draft, profile=profile)
    from app.engine.engine import Engine

    return Engine.load(target, draft, profile=profile)


def cmd_generate(a) -> int:
    params = _params(a)  # invalid combinations fail here, before any model loads
    if a.n < 1:
        raise ConfigError(f"--n must be >= 1, got {a.n}")
    from app import attachments

    files = attachments.unique_names(attachments.read_paths(a.file))  # unreadable files fail before loading
    target, draft = _specs(a, need_draft=params.needs_draft)
    engine = open_engine(target, draft if params.uses_draft or params.mode == "auto" else None,
                         profile=_profile(a))
    try:
        tok = engine.tokenizer

        def encode(messages: list[dict]) -> list[int]:
            if a.raw:  # no chat template: the user turn's text alone
                return ([tok.bos_id] if tok.add_bos and tok.bos_id is not None else []) + tok.encode(
                    messages[-1]["content"])
            return engine.encode(messages)

        chat = ([{"role": "system", "content": a.system}] if a.system else []) + [
            {"role": "user", "content": a.prompt, "attachments": files}]
        built = attachments.chat_prompt(chat, attachments.Window.of(engine, params, encode=encode))
        if files:  # whole when they fit, else the passages the prompt needs (said on stderr)
            print(f"dsbd-chat: {built.budgets[built.last].line()}; {built.plans[built.last].describe(files)}",
                  file=sys.stderr)
        prompt = encode(built.messages)
        if a.n == 1 and not a.json:  # stream to the terminal
            shown = ""
            for i, ev in enumerate(engine.generate(prompt, params)):
                if i == 0 and ev.notice:
                    print(f"dsbd-chat: {ev.notice}", file=sys.stderr)
                sys.stdout.write(ev.text[len(shown):])
                sys.stdout.flush()
                shown = ev.text
            sys.stdout.write("\n")
            return 0
        completions = engine.complete(prompt, params, n=a.n)
    finally:
        engine.close()
    if a.json:
        first = completions[0]
        print(json.dumps({"text": first["text"], "tokens": first["tokens"], "mode": params.mode,
                          "params": params.as_dict(), "stats": _aggregate(completions),
                          "completions": completions}, indent=2))
    else:
        for i, c in enumerate(completions):
            print(f"--- completion {i + 1}\n{c['text']}")
    return 0


def _aggregate(completions: list[dict]) -> dict:
    """One completion's stats, or means over several."""
    if len(completions) == 1:
        return completions[0]["stats"]
    keys = ("tokens_per_s", "steps_per_target_pass", "target_passes_per_token", "mean_target_logprob",
            "time_to_first_token_s", "target_passes", "new_tokens")
    out = {"n": len(completions)}
    for k in keys:
        vals = [c["stats"][k] for c in completions if c["stats"].get(k) is not None]
        out[k] = sum(vals) / len(vals) if vals else None
    return out




LOOPBACK = ("127.0.0.1", "localhost", "::1")


def bind_address(a) -> str:
    """The chat server's address: --host if given, else 0.0.0.0 with --listen, else loopback.
    Anything but loopback prints a warning (with whether a login protects it)."""
    host = a.host or ("0.0.0.0" if a.listen else "127.0.0.1")
    if host not in LOOPBACK:
        guard = "the UI and API need the --auth login" if a.auth else \
            "no login is set (add --auth USER:PASS)" + ("" if a.api_key else " and the API is open (add --api-key)")
        print(f"dsbd-chat: warning: listening on {host}: anyone who can reach this machine can use your models; "
              f"{guard}", file=sys.stderr)
    return host


def parse_auth(text: str | None) -> tuple[str, str] | None:
    """'user:pass' -> (user, pass); the password may contain ':'."""
    if not text:
        return None
    user, sep, password = text.partition(":")
    if not sep or not user or not password:
        raise ConfigError("--auth needs USER:PASS (both non-empty), e.g. --auth alice:correct-horse")
    return user, password


def cmd_chat(a) -> int:
    host, auth = bind_address(a), parse_auth(a.auth)  # before the (slow) model load
    target, draft = _specs(a, need_draft=False)
    profile = _profile(a)
    from app.serve.ui import QUEUE_KWARGS, build_app, launch_kwargs

    if a.no_worker and target.rpc:
        raise ConfigError("--rpc needs the supervised model process (a lost worker aborts the process that "
                          "holds the model): drop --no-worker")
    engine = open_engine(target, draft, supervised=not a.no_worker, profile=profile)
    # While the page opens, not at message 1: the first answer's contexts, and (the default preset sizes DSBD
    # forests from timed passes) the pass timing.
    threading.Thread(target=_warm_up, args=(engine, draft is not None), daemon=True).start()
    try:
        print(f"dsbd-chat: {engine.describe()}", file=sys.stderr)
        if a.share:  # a Gradio share tunnel needs Gradio's own launch; the API stays off the public link
            app = build_app(engine)
            app.queue(**QUEUE_KWARGS).launch(server_name=host, server_port=a.port, share=True, auth=auth,
                                             inbrowser=not a.no_browser, **launch_kwargs(app))
            return 0
        from app.serve.api import serve

        serve(engine, host=host, port=a.port, api_key=a.api_key, auth=auth, inbrowser=not a.no_browser)
        return 0
    finally:
        engine.close()


def _warm_up(engine, time_passes: bool) -> None:
    """Engine.prepare(), then Engine.costs(), in the background; a failure only means the first answer makes its
    contexts, or the first adaptive answer times the passes, itself."""
    try:
        engine.prepare()
        if time_passes:
            engine.costs()
    except Exception as e:  # noqa: BLE001 (a dead model process, say: the supervisor reports it on use)
        print(f"dsbd-chat: could not prepare the models yet ({e})", file=sys.stderr)


def cmd_bench(a) -> int:
    from pathlib import Path

    from app.compare import bench

    keep = _given_warp(a)
    base = _params(a, validate=False)  # each bench mode resolves its own defaults (W_S = W + 1 for dsbd)
    prompts = bench.load_suite(a.suite)[: a.prompts or None]
    modes = bench.split_modes(a.modes)
    for m in modes:
        bench.parse_mode(m, base, keep=keep)  # bad settings fail before any model loads
    target, draft = _specs(a, need_draft=any(bench.parse_mode(m, base, keep=keep)[1].needs_draft for m in modes))
    from app.engine.planning import placed_profile

    profile = cost_profile(_profile(a))
    engine = open_engine(target, draft, profile=a.cost_profile)
    try:
        profile = placed_profile(profile, target, draft)
        out = Path(a.json) if a.json else None
        result = bench.run_bench(engine, modes=modes, prompts=prompts, base=base, repeats=a.repeats, out=out,
                                 profile=profile, keep=keep)
    finally:
        engine.close()
    if a.plot:
        from app.compare.report import plot_bench

        plot_bench(result, Path(a.plot))
    print(json.dumps(result["summary"], indent=2))
    return 0


def cmd_compare(a) -> int:
    """A prompt set through several modes (one seed per prompt, shared by the modes), saved beside the chat
    history like the Compare tab's: code tasks graded by their hidden tests, chat prompts left for blind votes."""
    from pathlib import Path

    from app.compare import runner
    from app.compare.store import ResultStore, to_csv, to_json

    store = ResultStore(a.data_dir)
    keep = _given_warp(a)
    base = _params(a, validate=False)
    run, params, items = runner.prepare(store, resume=a.resume, modes=a.modes, suite=a.suite, prompts=a.prompts,
                                        base=base, keep=keep)
    target, draft = _specs(a, need_draft=any(p.needs_draft for p in params.values()))
    engine = open_engine(target, draft, profile=_profile(a))
    try:
        run, params = runner.start(engine, store, run, params, items=items, source=a.suite,
                                   settings=base.as_dict(), seed=a.seed, system=a.system or "")
        total = len(run["items"])
        print(f"dsbd-chat: run {run['id']}: {total} prompts x {len(params)} modes, {len(run['done'])} done; "
              f"results in {store.dir}", file=sys.stderr)
        try:
            for _rec in runner.iter_run(engine, store, run, params, cancel=threading.Event()):
                print(f"dsbd-chat: {len(run['done'])}/{total} done", file=sys.stderr)
        except KeyboardInterrupt:
            runner.stop(store, run)
            print(f"dsbd-chat: stopped at {len(run['done'])}/{total}; resume with --resume {run['id']}",
                  file=sys.stderr)
            return 130
    finally:
        engine.close()
    out, records = runner.summary(store, run)
    if a.export:
        path = Path(a.export)
        path.write_text(to_csv(records) if path.suffix == ".csv" else to_json(records))
    if a.report:
        from app.compare.report import write_report

        out["report"] = [str(p) for p in write_report(records, Path(a.report))]
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        for m, s in out["summary"].items():
            pr = f"pass {s['pass_rate']:.2f} ({s['passed']}/{s['graded']})" if s["graded"] else ""
            lp = f"log-p {s['mean_target_logprob']:.3f}" if s["mean_target_logprob"] is not None else ""
            tps = f"{s['tokens_per_s_median']:.1f} tok/s" if s["tokens_per_s_median"] is not None else "-"
            print(f"{m:24s} {tps:>12s}  {lp:14s} {pr}")
        if out["waiting_for_votes"]:
            print(f"{out['waiting_for_votes']} comparisons wait for blind votes: open the app, Compare -> "
                  "Vote on the next pending")
    return 0


def cmd_plan(a) -> int:
    """Memory plan (and, with a cost profile, speed projections) without loading any weights."""
    from app.engine.planning import parse_size, plan_models, plan_request

    def size(flag: str, text: str | None) -> int | None:
        try:
            return None if text is None else parse_size(text)
        except ValueError as e:
            raise ConfigError(f"{flag}: {e}") from None

    target, draft = _specs(a, need_draft=False)
    request = plan_request(a.mode, draft=draft is not None, context=a.ctx, beams=a.beams, draft_beams=a.draft_beams,
                           gamma=a.gamma, target_backend=a.target_backend, draft_backend=a.draft_backend,
                           dtype=a.dtype, ring=a.ring)
    report = plan_models(target, draft, request, vram=size("--vram", a.vram), ram=size("--ram", a.ram),
                         vram_reserve=size("--reserve", a.reserve), ram_reserve=size("--ram-reserve", a.ram_reserve),
                         device=a.device, profile=a.cost_profile, h2d_gbps=a.h2d_gbps, tflops=a.tflops,
                         mem_gbps=a.mem_gbps, bench_json=a.bench_json, acceptance=a.acceptance)
    hosts = _rpc_hosts(target, draft, a) if target.rpc else None
    if a.json:
        print(json.dumps(report.as_dict() | ({"rpc_hosts": [h.__dict__ | {"fits": h.fits} for h in hosts]}
                                             if hosts else {}), indent=2))
    else:
        print(report.format())
        if hosts:
            from offload.plan import format_hosts

            print()
            print(format_hosts(hosts))
    return 0


def _rpc_hosts(target: ModelSpec, draft: ModelSpec | None, a):
    """`plan --rpc`: memory per machine, from what each worker reports free."""
    import psutil

    from backends.host import rpc_devices
    from backends.modelfiles.resolution import resolve
    from offload.geometry import read_geometry
    from offload.plan import plan_hosts

    r = resolve(target.source, role="target")
    geo = read_geometry(r.path, name=r.name)
    devices = rpc_devices(target.rpc)
    draft_bytes = resolve(draft.source, role="draft").path.stat().st_size if draft is not None else 0
    layers = target.n_gpu_layers if target.n_gpu_layers is not None and target.n_gpu_layers >= 0 else geo.n_layers
    workers = [(f"{d['endpoint']} {d['device']}", d["free"]) for d in devices]
    return plan_hosts(geo, workers, context=a.ctx, rows=a.beams, host_free=psutil.virtual_memory().available,
                      draft_bytes=draft_bytes, host_layers=geo.n_layers - min(layers, geo.n_layers))


def cmd_rpc_worker(a) -> int:
    """Serve this machine's devices to one dsbd-chat (its target's layers) over llama.cpp's RPC protocol."""
    from backends import remote
    from backends.host import require_rpc, serve_rpc

    if a.threads is not None and a.threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {a.threads}")
    endpoint = remote.join(*remote.split(remote.join(a.host, a.port)))
    require_rpc()
    if not remote.is_loopback(a.host):
        print(f"dsbd-chat: warning: serving on {a.host}: {remote.SECURITY}", file=sys.stderr)
    # Ctrl+C ends the process from the moment it is promised: a SIGINT that Python's handler took just before the
    # native loop blocks would be lost there, and the worker would never stop
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    print(f"dsbd-chat: RPC worker on {endpoint}; on the chat machine run: dsbd-chat --rpc {endpoint} "
          f"(with this machine's address); Ctrl+C stops it", file=sys.stderr, flush=True)
    serve_rpc(a.host, a.port, threads=a.threads, cache=a.cache)
    return 0




def _chat_parser(sub) -> None:
    chat = sub.add_parser("chat", help="open the chat app in the browser (default)")
    _model_args(chat)
    chat.add_argument("--listen", action="store_true",
                      help="serve on every network interface (0.0.0.0), not only this machine; prints a warning")
    chat.add_argument("--host", default=None, help="bind address (default 127.0.0.1, loopback only; "
                                                   "0.0.0.0 with --listen)")
    chat.add_argument("--port", type=int, default=7860)
    chat.add_argument("--no-browser", action="store_true", help="don't open a browser tab")
    chat.add_argument("--share", action="store_true", help="create a public Gradio share link (off by default)")
    chat.add_argument("--no-worker", action="store_true",
                      help="run the models in the server's own process (debugging; a native crash then ends the "
                           "server) instead of a supervised model process that restarts after a crash")
    chat.add_argument("--api-key", default=os.environ.get("DSBD_CHAT_API_KEY"),
                      help="require 'Authorization: Bearer KEY' on the OpenAI-compatible API at /v1 "
                           "(default: $DSBD_CHAT_API_KEY; none = open, fine on loopback)")
    chat.add_argument("--auth", default=os.environ.get("DSBD_CHAT_AUTH"), metavar="USER:PASS",
                      help="require this login for the UI, and for the API as HTTP basic auth (or the "
                           "--api-key) (default: $DSBD_CHAT_AUTH, which keeps the password out of `ps`)")


def _generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help="generate one answer in the terminal")
    _model_args(gen)
    _decode_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--system", default=None, help="system prompt")
    gen.add_argument("--raw", action="store_true", help="no chat template: continue the raw text")
    gen.add_argument("--file", action="append", default=[], metavar="PATH",
                     help="attach a file (repeatable): text, code, Markdown, CSV, JSON or PDF, put before the prompt "
                          "whole when the files fit the context, else the passages the prompt needs (BM25), cited "
                          "by file and lines")
    gen.add_argument("--n", type=int, default=1, help="independent completions (derived seeds), one model load")
    gen.add_argument("--json", action="store_true")


def _bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmark decoding modes interleaved (JSON summary, optional plot)")
    _model_args(bench)
    _decode_args(bench)
    bench.set_defaults(**dict.fromkeys(WARP))  # given or not: a preset mode keeps a given warp (_given_warp)
    bench.add_argument("--modes", default="sample,beam-sample,sps,dsbd,dsbd-mem",
                       help="comma-separated modes, each optionally with settings: dsbd:beams=2,gamma=4")
    bench.add_argument("--suite", default="chat",
                       help="suite in assets/bench: chat (log-prob) or code (pass rate of hidden tests); or a .json path")
    bench.add_argument("--prompts", type=int, default=0, help="use only the first N prompts (0 = all)")
    bench.add_argument("--repeats", type=int, default=1)
    bench.add_argument("--json", help="write all runs + summary here (resumes a partial file)")
    bench.add_argument("--plot", help="write a speed-vs-quality PNG here (and <stem>-acceptance / -widths PNGs)")


def _compare_parser(sub) -> None:
    cmp = sub.add_parser("compare", help="run a prompt set through several modes; saved for blind votes and "
                                         "the quality report (code suite: pass rates)")
    _model_args(cmp)
    _decode_args(cmp)
    cmp.set_defaults(**dict.fromkeys(WARP))
    cmp.add_argument("--modes", default="greedy,beam-sample,dsbd",
                     help="comma-separated modes, each optionally with settings: dsbd:beams=2,gamma=4")
    cmp.add_argument("--suite", default="chat", help="chat | code | a bench .json, a .jsonl or a .txt of prompts")
    cmp.add_argument("--prompts", type=int, default=0, help="use only the first N prompts (0 = all)")
    cmp.add_argument("--system", default=None, help="system prompt")
    cmp.add_argument("--resume", metavar="RUN_ID", help="go on with a stopped run (its own prompts and settings)")
    cmp.add_argument("--data-dir", default=None, help="where results are kept (default: $DSBD_CHAT_DATA or the "
                                                      "platform data folder, beside the chat history)")
    cmp.add_argument("--export", help="also write this run's comparisons to FILE.json or FILE.csv")
    cmp.add_argument("--report", metavar="DIR", help="write the quality report (PNG + HTML per model pair) here")
    cmp.add_argument("--json", action="store_true", help="print the summary as JSON")


def _rpc_worker_parser(sub) -> None:
    rpcw = sub.add_parser("rpc-worker", help="serve this machine's devices (GPU, else CPU) to one dsbd-chat "
                                             "as a llama.cpp RPC worker (holds target layers for --rpc)")
    rpcw.add_argument("--host", default="127.0.0.1",
                      help="address to listen on (default 127.0.0.1: loopback only; anything else prints a "
                           "warning: the protocol has no authentication, tunnel it over SSH or a VPN)")
    rpcw.add_argument("--port", type=int, default=50052)
    rpcw.add_argument("--threads", type=int, default=None, help="CPU threads (default: physical cores)")
    rpcw.add_argument("--cache", default=None, metavar="DIR",
                      help="keep received large tensors here by hash, so a reload of the same model sends "
                           "hashes instead of those weights (llama.cpp hashes only tensors above a size threshold)")


def _plan_parser(sub) -> None:
    plan = sub.add_parser("plan", help="memory plan for target + draft + beams (and projected speed); loads no weights")
    _model_args(plan)
    plan.add_argument("--context", dest="ctx", type=int, default=argparse.SUPPRESS,
                      help="tokens per sequence: prompt + answer + draft tree (same as --ctx; default 4096)")
    plan.add_argument("--mode", choices=MODES, default="auto",
                      help="decoding mode to plan for; auto: dsbd or dsbd-mem, whichever keeps more weights in "
                           "VRAM (beam-sample without a draft)")
    for field in ("beams", "draft_beams", "gamma"):
        _knob(plan, field, type=int, default=getattr(DecodeParams, field))
    plan.add_argument("--vram", help="GPU memory to use, e.g. 8GiB, 8GB, 512MiB; 0 = CPU only (default: free VRAM)")
    plan.add_argument("--ram", help="host memory to use (default: available RAM)")
    plan.add_argument("--reserve", default="512MiB", help="VRAM kept free for the CUDA context and allocator")
    plan.add_argument("--ram-reserve", default="2GiB", help="RAM kept free for the OS and the app")
    plan.add_argument("--ring", type=int, default=2, help="GPU buffers for streamed layers (pytorch backend)")
    plan.add_argument("--h2d-gbps", type=float, help="a custom datasheet cost profile: host-to-device GB/s "
                      "(over --cost-profile's datasheet where one is named)")
    plan.add_argument("--tflops", type=float, help="a custom datasheet: GPU matmul TFLOP/s")
    plan.add_argument("--mem-gbps", type=float, help="a custom datasheet: GPU memory GB/s")
    plan.add_argument("--bench-json", help="acceptance statistics from `dsbd-chat bench --json FILE`")
    plan.add_argument("--acceptance", type=float, default=ACCEPTANCE_PRIOR,
                      help=f"assumed per-token acceptance when no --bench-json is given (default {ACCEPTANCE_PRIOR})")
    plan.add_argument("--json", action="store_true")

def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dsbd-chat", description="Local chat with speculative beam decoding")
    sub = ap.add_subparsers(dest="command")
    _chat_parser(sub)
    _generate_parser(sub)
    _bench_parser(sub)
    _compare_parser(sub)
    add_models_parser(sub)
    _rpc_worker_parser(sub)
    _plan_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["chat", *argv]  # the chat app is the default command
    a = build_parser().parse_args(argv)
    keep_freed_rows()
    handlers = {"chat": cmd_chat, "generate": cmd_generate, "models": cmd_models, "bench": cmd_bench,
                "plan": cmd_plan, "compare": cmd_compare, "rpc-worker": cmd_rpc_worker}
    from app.attachments import AttachmentError
    from app.prompt import ChatError
    from app.compare.records import ResultsError
    from backends.base import BackendError

    try:
        return handlers[a.command](a)
    except (ConfigError, BackendError, ChatError, ResultsError, AttachmentError) as e:
        print(f"dsbd-chat: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

