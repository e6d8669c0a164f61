"""`dsbd-chat` and its subcommands: the chat UI (default), generate, models. The only argument parser."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

from app.config import BACKENDS, DTYPES, FOREST_POLICIES, MODES, QUALITY_LEVELS, ConfigError, DecodeParams, ModelSpec

PRESET_DEFAULT = "tiny"


def _model_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("models")
    g.add_argument("--preset", default=PRESET_DEFAULT, help="model preset: tiny | qwen-coder (default: tiny)")
    g.add_argument("--target", help="target model: preset, local .gguf, safetensors folder, or org/name[:file.gguf]")
    g.add_argument("--draft", help="draft model (same forms as --target); defaults to the preset's draft")
    g.add_argument("--target-backend", choices=BACKENDS, default="llamacpp")
    g.add_argument("--draft-backend", choices=BACKENDS, default="llamacpp")
    g.add_argument("--dtype", choices=DTYPES, default="float32", help="pytorch runtime dtype")
    g.add_argument("--device", default="cpu", help="pytorch runtime device: cpu | cuda | cuda:N")
    g.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: physical cores)")
    g.add_argument("--n-gpu-layers", type=int, default=None,
                   help="llama.cpp layers on the GPU (-1 = all; default: from the memory plan)")
    g.add_argument("--ctx", type=int, default=4096, help="context window in tokens (prompt + answer + draft tree)")
    g.add_argument("--llama-extra-bufts", choices=("auto", "on", "off"), default="auto",
                   help="llama.cpp weight repack (AMX and others); auto: $DSBD_CHAT_LLAMA_EXTRA_BUFTS, else a "
                        "cached one-time probe that turns it off where it crashes (AMX CPUs)")


def _decode_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("decoding")
    g.add_argument("--mode", choices=MODES, default="greedy",
                   help="auto: the fastest setting of --quality, from timed passes and measured acceptance")
    g.add_argument("--quality", choices=QUALITY_LEVELS, default="fast",
                   help="auto only: fast = sample/sps, beam = beam-sample/dsbd (W_min >= 2), dynamic = dsbd with W_min = W")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off; counts (beam, token) pairs")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--beams", type=int, default=4, help="W: beams carried between steps")
    g.add_argument("--draft-beams", type=int, default=None, help="W_S: drafts per forest layer (default W+1)")
    g.add_argument("--gamma", type=int, default=3, help="draft depth per iteration")
    g.add_argument("--threshold", type=float, default=0.9, help="t: dynamic-width threshold in [0, 1]")
    g.add_argument("--min-beams", type=int, default=1, help="W_min: smallest layer width")
    g.add_argument("--select", choices=("best", "sample"), default="best", help="dsbd-mem: carried beam")
    g.add_argument("--forest", choices=FOREST_POLICIES, default="fixed",
                   help="dsbd / dsbd-mem: fixed gamma and W_S, or adaptive: per iteration gamma in 0..--gamma and "
                        "W_S in W..--draft-beams, sized to the timed pass costs (times the passes on first use)")
    g.add_argument("--length-penalty", type=float, default=1.0)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--no-unique-paths", dest="unique_paths", action="store_false",
                   help="score every forest entry, repeats included (same answers, more work; for comparisons)")


def _params(a, *, validate: bool = True) -> DecodeParams:
    p = DecodeParams(mode=a.mode, max_new_tokens=a.max_tokens, temperature=a.temperature, top_k=a.top_k,
                     top_p=a.top_p, beams=a.beams, draft_beams=a.draft_beams, gamma=a.gamma,
                     threshold=a.threshold, min_beams=a.min_beams, select=a.select,
                     length_penalty=a.length_penalty, seed=a.seed, stop=tuple(a.stop), quality=a.quality,
                     forest=a.forest, unique_paths=getattr(a, "unique_paths", True))
    return p.validated() if validate else p


def _specs(a, *, need_draft: bool) -> tuple[ModelSpec, ModelSpec | None]:
    common = dict(dtype=a.dtype, device=a.device, n_threads=a.threads, n_gpu_layers=a.n_gpu_layers, n_ctx=a.ctx,
                  llama_extra_bufts=a.llama_extra_bufts)
    target = ModelSpec(source=a.target or a.preset, backend=a.target_backend, **common).validated()
    draft_src = a.draft or (a.preset if not a.target else None)
    if need_draft and draft_src is None:
        raise ConfigError("this mode needs a draft model: pass --draft (a small model sharing the target's vocabulary)")
    draft = ModelSpec(source=draft_src, backend=a.draft_backend, **common).validated() if draft_src else None
    return target, draft


def cmd_generate(a) -> int:
    params = _params(a)  # invalid combinations fail here, before any model loads
    if a.n < 1:
        raise ConfigError(f"--n must be >= 1, got {a.n}")
    target, draft = _specs(a, need_draft=params.needs_draft)
    from app.engine.engine import Engine

    engine = Engine.load(target, draft if params.needs_draft or params.mode == "auto" else None)
    try:
        tok = engine.tokenizer
        if a.raw:
            prompt = ([tok.bos_id] if tok.add_bos and tok.bos_id is not None else []) + tok.encode(a.prompt)
        else:
            messages = ([{"role": "system", "content": a.system}] if a.system else []) + \
                [{"role": "user", "content": a.prompt}]
            prompt = engine.encode(messages)
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


def cmd_models(a) -> int:
    from backends.registry import format_models_table, list_models

    from backends.llamacpp.probe import cpu_summary, probe_summary

    rows = list_models()
    cpu = {"cpu": cpu_summary(), "llama_weight_repack": probe_summary()}
    print(json.dumps({"models": rows} | cpu, indent=2) if a.json else
          format_models_table(rows) + f"\nCPU: {cpu['cpu']}; {cpu['llama_weight_repack']}")
    return 0


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
    from app.serve.ui import QUEUE_KWARGS, build_app, launch_kwargs

    if a.no_worker:
        from app.engine.engine import Engine

        engine = Engine.load(target, draft)
    else:  # the models run in a supervised child process: a native crash ends one answer, not the server
        from app.engine.worker import WorkerEngine

        engine = WorkerEngine.load(target, draft)
    if draft is not None:  # the default preset sizes DSBD forests from timed passes: time them now, while the
        threading.Thread(target=_time_passes, args=(engine,), daemon=True).start()  # page opens, not at message 1
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


def _time_passes(engine) -> None:
    """Engine.costs() in the background; a failure only means the first adaptive answer times them itself."""
    try:
        engine.costs()
    except Exception as e:  # noqa: BLE001 (a dead model process, say: the supervisor reports it on use)
        print(f"dsbd-chat: could not time the model passes yet ({e})", file=sys.stderr)


def cmd_bench(a) -> int:
    from pathlib import Path

    from app.compare import bench

    base = _params(a, validate=False)  # each bench mode resolves its own defaults (W_S = W + 1 for dsbd)
    prompts = bench.load_suite(a.suite)[: a.prompts or None]
    modes = bench.split_modes(a.modes)
    for m in modes:
        bench.parse_mode(m, base)  # bad settings fail before any model loads
    target, draft = _specs(a, need_draft=any(bench.parse_mode(m, base)[1].needs_draft for m in modes))
    from app.engine.engine import Engine

    engine = Engine.load(target, draft)
    try:
        out = Path(a.json) if a.json else None
        result = bench.run_bench(engine, modes=modes, prompts=prompts, base=base, repeats=a.repeats, out=out)
    finally:
        engine.close()
    if a.plot:
        bench.plot(result, Path(a.plot))
    print(json.dumps(result["summary"], indent=2))
    return 0


def cmd_compare(a) -> int:
    """A prompt set through several modes (one seed per prompt, shared by the modes), saved beside the chat
    history like the Compare tab's: code tasks graded by their hidden tests, chat prompts left for blind votes."""
    from pathlib import Path

    from app.compare import bench, results

    store = results.ResultStore(a.data_dir)
    if a.resume:
        run = store.load_run(a.resume)
        if run["state"] == "done":
            raise ConfigError(f"run {a.resume} is complete")
        params = results.params_of_run(run)
    else:
        base = _params(a, validate=False)
        params = dict(bench.parse_mode(m, base) for m in bench.split_modes(a.modes))
        items = results.load_prompt_source(a.suite)[: a.prompts or None]
        if len(params) < 2:
            raise ConfigError(f"--modes needs at least two modes to compare, got {a.modes!r}")
    target, draft = _specs(a, need_draft=any(p.needs_draft for p in params.values()))
    from app.engine.engine import Engine

    engine = Engine.load(target, draft)
    try:
        params = {m: engine.check_params(p) for m, p in params.items()}
        if a.resume and run["models"] != engine.describe():
            raise ConfigError(f"run {a.resume} was made with {run['models']}; load the same models to resume it")
        if not a.resume:
            run = results.new_run(source=a.suite, items=items, params=params, settings=base.as_dict(),
                                  models=engine.describe(), seed=a.seed, system=a.system or "")
        total = len(run["items"])
        print(f"dsbd-chat: run {run['id']}: {total} prompts x {len(params)} modes, {len(run['done'])} done; "
              f"results in {store.dir}", file=sys.stderr)

        def report(r, rec):
            print(f"dsbd-chat: {len(r['done'])}/{total} done", file=sys.stderr)

        try:
            results.run_items(engine, store, run, params, cancel=threading.Event(), on_item=report)
        except KeyboardInterrupt:
            run["state"] = "stopped"
            store.save_run(run)
            print(f"dsbd-chat: stopped at {len(run['done'])}/{total}; resume with --resume {run['id']}",
                  file=sys.stderr)
            return 130
    finally:
        engine.close()
    records = [store.load(i) for i in run["comparisons"]]
    out = {"run": run["id"], "state": run["state"], "done": len(run["done"]), "prompts": total,
           "waiting_for_votes": sum(results.needs_vote(r) for r in records),
           "summary": results.mode_summary(records)}
    if a.export:
        path = Path(a.export)
        path.write_text(results.to_csv(records) if path.suffix == ".csv" else results.to_json(records))
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
    """Memory plan (and, with a hardware profile, speed projections) without loading any weights."""
    from dataclasses import replace

    from backends.registry import resolve
    from offload.geometry import read_geometry
    from offload.plan import GiB, Budget, PlanRequest, parse_size, plan

    def size(flag: str, text: str | None) -> int | None:
        try:
            return None if text is None else parse_size(text)
        except ValueError as e:
            raise ConfigError(f"{flag}: {e}") from None

    hw = None
    if a.profile or any(x is not None for x in (a.h2d_gbps, a.tflops, a.mem_gbps)):
        from offload.cost import profile

        hw = profile(a.profile, h2d_gbps=a.h2d_gbps, tflops=a.tflops, mem_gbps=a.mem_gbps)
    vram, ram = size("--vram", a.vram), size("--ram", a.ram)
    from_profile = vram is None and a.profile is not None
    if from_profile:
        vram = int(hw.vram_gb * GiB)
    budget = Budget.detect(vram=vram, ram=ram, vram_reserve=size("--reserve", a.reserve),
                           ram_reserve=size("--ram-reserve", a.ram_reserve),
                           device=a.device if a.device.startswith("cuda") else "cuda")  # --vram 0 plans CPU-only
    source = f"VRAM {'profile ' + a.profile if from_profile else 'explicit' if a.vram else 'detected'}, " \
             f"RAM {'explicit' if a.ram else 'detected'}"
    budget = replace(budget, source=source)
    target, draft = _specs(a, need_draft=False)
    t = resolve(target.source, role="target")
    d = resolve(draft.source, role="draft") if draft is not None else None
    tgeo = read_geometry(t.path, name=t.name)
    dgeo = read_geometry(d.path, name=d.name) if d is not None else None
    request = PlanRequest(context=a.ctx, beams=a.beams, draft_beams=a.draft_beams, gamma=a.gamma, mode=a.mode,
                          target_backend=a.target_backend, draft_backend=a.draft_backend, dtype=a.dtype, ring=a.ring)
    p = plan(tgeo, dgeo, request, budget)
    projections = []
    if hw is not None:
        from offload.cost import DEFAULT_MODES, assumed_stats, format_projections, project, read_bench

        req = request.validated()
        if a.bench_json:
            stats = read_bench(a.bench_json, beams=req.beams, draft_beams=req.draft_beams, gamma=req.gamma)
        else:
            stats = [assumed_stats(m, beams=req.beams, draft_beams=req.draft_beams, gamma=req.gamma,
                                   acceptance=a.acceptance) for m in DEFAULT_MODES]
        projections = project(tgeo, dgeo, req, budget, hw, stats)
    if a.json:
        out = {"plan": p.as_dict(), "models": {"target": tgeo.__dict__ | {"path": str(t.path)},
                                               "draft": dgeo.__dict__ | {"path": str(d.path)} if dgeo else None}}
        if hw is not None:
            out |= {"hardware": hw.__dict__, "projections": [x.as_dict() for x in projections]}
        print(json.dumps(out, indent=2))
        return 0
    desc = f"target {tgeo.name} ({tgeo.quant}, {tgeo.n_layers} layers, {tgeo.weight_bytes / GiB:.2f} GiB)"
    if dgeo is not None:
        desc += f"; draft {dgeo.name} ({dgeo.quant}, {dgeo.n_layers} layers, {dgeo.weight_bytes / GiB:.2f} GiB)"
    print(desc)
    print(p.format())
    if hw is not None:
        print()
        print(format_projections(hw, projections))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dsbd-chat", description="Local chat with speculative beam decoding")
    sub = ap.add_subparsers(dest="command")
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
    gen = sub.add_parser("generate", help="generate one answer in the terminal")
    _model_args(gen)
    _decode_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--system", default=None, help="system prompt")
    gen.add_argument("--raw", action="store_true", help="no chat template: continue the raw text")
    gen.add_argument("--n", type=int, default=1, help="independent completions (derived seeds), one model load")
    gen.add_argument("--json", action="store_true")
    bench = sub.add_parser("bench", help="benchmark decoding modes interleaved (JSON summary, optional plot)")
    _model_args(bench)
    _decode_args(bench)
    bench.add_argument("--modes", default="sample,beam-sample,sps,dsbd,dsbd-mem",
                       help="comma-separated modes, each optionally with settings: dsbd:beams=2,gamma=4")
    bench.add_argument("--suite", default="chat",
                       help="suite in assets/bench: chat (log-prob) or code (pass rate of hidden tests); or a .json path")
    bench.add_argument("--prompts", type=int, default=0, help="use only the first N prompts (0 = all)")
    bench.add_argument("--repeats", type=int, default=1)
    bench.add_argument("--json", help="write all runs + summary here (resumes a partial file)")
    bench.add_argument("--plot", help="write a speed-vs-quality PNG here (and <stem>-acceptance / -widths PNGs)")
    cmp = sub.add_parser("compare", help="run a prompt set through several modes; saved for blind votes and "
                                         "the quality report (code suite: pass rates)")
    _model_args(cmp)
    _decode_args(cmp)
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
    models = sub.add_parser("models", help="list model presets and their install state")
    models.add_argument("--json", action="store_true")
    plan = sub.add_parser("plan", help="memory plan for target + draft + beams (and projected speed); loads no weights")
    _model_args(plan)
    plan.add_argument("--context", dest="ctx", type=int, default=argparse.SUPPRESS,
                      help="tokens per sequence: prompt + answer + draft tree (same as --ctx; default 4096)")
    plan.add_argument("--mode", choices=MODES, default="auto",
                      help="decoding mode to plan for; auto: dsbd or dsbd-mem, whichever keeps more weights in "
                           "VRAM (beam-sample without a draft)")
    plan.add_argument("--beams", type=int, default=4, help="W: beams carried between steps")
    plan.add_argument("--draft-beams", type=int, default=None, help="W_S: drafts per forest layer (default W+1)")
    plan.add_argument("--gamma", type=int, default=3, help="draft depth per iteration")
    plan.add_argument("--vram", help="GPU memory to use, e.g. 8GiB, 8GB, 512MiB; 0 = CPU only (default: free VRAM)")
    plan.add_argument("--ram", help="host memory to use (default: available RAM)")
    plan.add_argument("--reserve", default="512MiB", help="VRAM kept free for the CUDA context and allocator")
    plan.add_argument("--ram-reserve", default="2GiB", help="RAM kept free for the OS and the app")
    plan.add_argument("--ring", type=int, default=2, help="GPU buffers for streamed layers (pytorch backend)")
    plan.add_argument("--profile", help="hardware profile for speed projections: laptop-8gb | rtx3060-12gb | "
                      "rtx4090-24gb | h200-141gb | cpu-only (its VRAM is the budget unless --vram is given)")
    plan.add_argument("--h2d-gbps", type=float, help="custom hardware: host-to-device GB/s")
    plan.add_argument("--tflops", type=float, help="custom hardware: GPU matmul TFLOP/s")
    plan.add_argument("--mem-gbps", type=float, help="custom hardware: GPU memory GB/s")
    plan.add_argument("--bench-json", help="acceptance statistics from `dsbd-chat bench --json FILE`")
    plan.add_argument("--acceptance", type=float, default=0.66,
                      help="assumed per-token acceptance when no --bench-json is given (default 0.66)")
    plan.add_argument("--json", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["chat", *argv]  # the chat app is the default command
    a = build_parser().parse_args(argv)
    handlers = {"chat": cmd_chat, "generate": cmd_generate, "models": cmd_models, "bench": cmd_bench,
                "plan": cmd_plan, "compare": cmd_compare}
    from backends.base import BackendError

    from app.chat import ChatError

    try:
        return handlers[a.command](a)
    except (ConfigError, BackendError, ChatError) as e:
        print(f"dsbd-chat: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
