"""`dsbd-chat models`: the model library on this machine and the Hugging Face Hub (list, search, download,
check, rm, show)."""

from __future__ import annotations

import argparse
import json
import sys
import threading

from app.config import without_draft
from backends.host import rpc_endpoints


def _models_list_args(p: argparse.ArgumentParser, *, child: bool) -> None:
    """The list options, on `models` itself (bare `dsbd-chat models`) and on `models list`."""
    keep = {"default": argparse.SUPPRESS} if child else {}
    p.add_argument("--json", action="store_true", **keep)
    p.add_argument("--dir", action="append", metavar="DIR", help="also list the .gguf files under DIR (this time)",
                   **keep)
    p.add_argument("--add-dir", action="append", metavar="DIR", help="remember DIR as a library folder", **keep)
    p.add_argument("--forget-dir", action="append", metavar="DIR", help="forget a remembered folder", **keep)
    p.add_argument("--fit", action="store_true", help="add whether each model fits this machine (reads free VRAM)",
                   **keep)
    p.add_argument("--draft", metavar="SRC", help="plan the fit with this draft beside each model (implies --fit)",
                   **keep)
    p.add_argument("--ctx", type=int, metavar="N", help="context for the fit (default 4096)",
                   **(keep or {"default": 4096}))
    p.add_argument("--rpc", metavar="HOST:PORT[,...]", help="also list these RPC workers' devices and free memory "
                   "(where a --rpc target's layers would live)", **keep)


def add_models_parser(sub) -> None:
    models = sub.add_parser("models", help="the models on this machine (library), Hugging Face search and "
                                           "downloads, draft compatibility")
    _models_list_args(models, child=False)
    acts = models.add_subparsers(dest="models_action")
    _models_list_args(acts.add_parser("list", help="the models on this machine (the default)"), child=True)
    search = acts.add_parser("search", help="search Hugging Face for GGUF models")
    search.add_argument("query", help="words of the repo name, e.g. 'qwen2.5 coder'")
    search.add_argument("--sort", choices=("downloads", "recent", "likes", "trending"), default="downloads")
    search.add_argument("--limit", type=int, default=20)
    search.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    dl = acts.add_parser("download", help="download a GGUF model from Hugging Face into the model cache (resumes a "
                                          "stopped download); with REPO alone, list its files and whether they fit")
    dl.add_argument("repo", metavar="REPO[:FILE]")
    dl.add_argument("--quant", help="pick the repo's file of this quantization, e.g. Q4_K_M")
    dl.add_argument("--draft", metavar="SRC", default=argparse.SUPPRESS,
                    help="fit estimate with this draft beside the target")
    dl.add_argument("--ctx", type=int, default=argparse.SUPPRESS, help="context for the fit estimate (default 4096)")
    dl.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    check = acts.add_parser("check", help="can DRAFT draft for TARGET (same sources as --target / --draft)? "
                                          "exit 0 when compatible, 1 when not; without DRAFT, suggest drafts")
    check.add_argument("target")
    check.add_argument("draft", nargs="?", default=None)
    check.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    rm = acts.add_parser("rm", help="delete a model from the library (asks first; names the space freed)")
    rm.add_argument("path", help="the model's file (any shard of a split model) or its id from the list")
    rm.add_argument("--yes", "-y", action="store_true", help="do not ask")
    rm.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    show = acts.add_parser("show", help="a model's metadata card (its GGUF header)")
    show.add_argument("path", help="the model's file or its id from the list")
    show.add_argument("--json", action="store_true", default=argparse.SUPPRESS)


def cmd_models(a) -> int:
    """`dsbd-chat models [list|search|download|check|rm|show]`: the model library and the Hugging Face Hub."""
    action = getattr(a, "models_action", None) or "list"
    return {"list": _models_list, "search": _models_search, "download": _models_download, "check": _models_check,
            "rm": _models_rm, "show": _models_show}[action](a)


def _table(head: tuple, rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in (head, *rows)) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in (head, *rows))


def _size(n: int | None) -> str:
    from backends.modelfiles.library import format_bytes

    return "-" if n is None else format_bytes(n)


def _models_list(a) -> int:
    from backends.modelfiles import library
    from backends.host import cpu_report
    from backends.modelfiles.presets import format_models_table, list_models

    for d in a.add_dir or []:
        library.add_folder(d)
    for d in a.forget_dir or []:
        library.remove_folder(d)
    found = library.scan(dirs=a.dir or [])
    fits = {}
    if a.fit or a.draft:
        from app.engine.planning import library_fits

        fits = library_fits(found.entries, draft=a.draft, context=a.ctx)
    presets, cpu = list_models(), cpu_report()
    workers = _worker_rows(rpc_endpoints(a.rpc))
    if a.json:
        out = found.as_dict() | {"presets": presets} | cpu | ({"rpc_workers": workers} if workers else {})
        if fits:
            out["fits"] = {k: v.as_dict() for k, v in fits.items()}
        print(json.dumps(out, indent=2))
        return 0
    rows = [(e.id, e.params_label or "-", e.quant or "-", e.context_length or "-", _size(e.size),
             "yes" if e.chat_template else "no", e.source, "ok" if e.usable else (e.problem or e.kind)[:60],
             *((fits[e.path].label,) if fits and e.path in fits else (("-",) if fits else ())))
            for e in found.entries]
    head = ("model", "params", "quant", "context", "size", "template", "source", "status", *(("fit",) if fits else ()))
    print(_table(head, rows) if rows else "no models found (dsbd-chat models search QUERY finds some on Hugging Face)")
    for e in found.entries:
        if not e.usable:
            print(f"  {e.id}: {e.problem or 'a ' + e.kind + ' file, not a language model'}")
    print("\nfolders:")
    for f in found.folders:
        n = sum(1 for e in found.entries if e.folder == f.path)
        state = f"{n} model{'s' * (n != 1)}" if f.exists else "not there"
        print(f"  {f.source:18s} {f.path}  ({state}{', remembered' if f.remembered else ''})")
    print(f"  (headers read {found.read}, cached {found.cached}, {found.seconds:.2f} s; add a folder with "
          "--add-dir DIR)")
    print("\npresets:\n" + format_models_table(presets))
    print(f"CPU: {cpu['cpu']}; {cpu['llama_weight_repack']}")
    if workers:
        print("with --rpc: target layers on " + "; ".join(
            f"{w['endpoint']} {w['device']} ({_size(w['free'])} free of {_size(w['total'])})"
            for w in workers) + "; the target's output head, embeddings and the draft on this machine")
    return 0


def _models_search(a) -> int:
    from backends.modelfiles import hub

    found = hub.search(a.query, sort=a.sort, limit=a.limit)
    if a.json:
        print(json.dumps([m.as_dict() for m in found], indent=2))
        return 0
    if not found:
        print(f"no GGUF models match {a.query!r} on Hugging Face")
        return 0
    rows = [(m.id, f"{m.downloads:,}" if m.downloads is not None else "-", m.likes if m.likes is not None else "-",
             (m.last_modified or "-")[:10], _fmt_params(m.params), m.arch or "-", "gated" if m.gated else "")
            for m in found]
    print(_table(("repo", "downloads", "likes", "updated", "params", "arch", ""), rows))
    print("\nits files and whether they fit: dsbd-chat models download REPO")
    return 0


def _fmt_params(n: int | None) -> str:
    from backends.modelfiles.library import format_params

    return format_params(n) or "-"


def _models_download(a) -> int:
    from backends.modelfiles import hub

    repo, _, filename = a.repo.partition(":")
    listing = hub.repo_files(repo)
    if not filename and not a.quant:
        return _show_repo(listing, a)
    group = _pick_group(listing, filename or a.quant)
    if not group.complete:
        raise hub.HubError(f"{group.name}: the repo lacks some of its {group.shards} shards; pick another file")
    return _download_group(listing.repo, group, a)


def _pick_group(listing, key: str):
    for g in listing.groups:
        if any(f.path == key for f in g.files):
            return g
    return listing.group(key)


def _show_repo(listing, a) -> int:
    from app.engine.planning import hub_fits

    try:
        fits = hub_fits(listing, draft=a.draft, context=a.ctx)
        note = ""
    except Exception as e:  # noqa: BLE001 (the badge is advice: the list stands without it)
        fits, note = {}, f"(no fit estimate: {e})"
    if a.json:
        print(json.dumps(listing.as_dict() | {"fits": {k: v.as_dict() for k, v in fits.items()}}, indent=2))
        return 0
    rows = [(g.quant, g.name, _size(g.size), f"{g.shards} files" if g.shards > 1 else "",
             "incomplete" if not g.complete else "", fits[g.name].label if g.name in fits else "-")
            for g in listing.groups if g.kind == "model"]
    print(_table(("quant", "file", "size", "shards", "", "fit"), rows) if rows else f"{listing.repo} has no GGUF models")
    if note:
        print(note)
    ctx = f"context {a.ctx}" + (f" with draft {a.draft}" if a.draft else " (no draft; add --draft SRC)")
    print(f"\nfit: target + KV at {ctx} on this machine; download one with: dsbd-chat models download "
          f"{listing.repo}:FILE (or --quant QUANT)")
    return 0


def _download_group(repo: str, group, a) -> int:
    from tqdm import tqdm

    from backends.modelfiles import hub

    paths = []
    for f in group.files:
        bar = None

        def show(p, f=f):
            nonlocal bar
            if a.json:
                return
            if bar is None:
                bar = tqdm(total=p.total, initial=p.done, unit="B", unit_scale=True, unit_divisor=1024,
                           desc=f.path.rsplit("/", 1)[-1][:40], disable=None)
            bar.update(p.done - bar.n)

        stop = threading.Event()
        try:
            paths.append(hub.download_file(repo, f.path, progress=show, stop=stop))
        except KeyboardInterrupt:
            stop.set()
            print("\ndsbd-chat: stopped; the partial file is kept: run the same command to continue", file=sys.stderr)
            return 130
        finally:
            if bar is not None:
                bar.close()
    if a.json:
        print(json.dumps({"repo": repo, "files": [str(p) for p in paths]}, indent=2))
    else:
        print(f"downloaded {group.name} ({_size(group.size)}) to {paths[0].parent}")
        print(f"use it: dsbd-chat --target {repo}:{group.files[0].path}")
    return 0


def _models_check(a) -> int:
    from backends.modelfiles import library
    from backends.modelfiles.resolution import resolve

    target = resolve(a.target, role="target")
    if a.draft is None:
        return _suggest(library, target, a)
    draft = resolve(a.draft, role="draft")
    verdict = library.check_pair(draft.path, target.path)
    if a.json:
        print(json.dumps(verdict.as_dict() | {"without_draft": without_draft()}, indent=2))
    elif verdict.compatible:
        print(f"compatible: {draft.name} can draft for {target.name}")
    else:
        print(f"not compatible: {draft.name} cannot draft for {target.name}:")
        for r in verdict.reasons:
            print(f"  - {r}")
        print(without_draft())
    return 0 if verdict.compatible else 1


def _suggest(library, target, a) -> int:
    entries = library.scan().entries
    entry = library.match_source(a.target, "target", entries) or library.find(target.path, entries)
    advice = library.suggest_drafts(entry, entries)
    if a.json:
        print(json.dumps(advice.as_dict() | {"without_draft": without_draft()}, indent=2))
        return 0 if advice.compatible else 1
    print(f"drafts for {entry.name}:")
    for c in advice.candidates:
        if c.compatible:
            print(f"  ok  {c.entry.id}  ({c.note})  {c.entry.path}")
    for c in advice.candidates:
        if not c.compatible:
            print(f"  no  {c.entry.id}: {'; '.join(c.reasons[:3])}")
    if not advice.compatible:
        print(without_draft())
    return 0 if advice.compatible else 1


def _models_rm(a) -> int:
    from backends.modelfiles import library

    plan = library.plan_delete(a.path)
    if plan.refused:
        if a.json:
            print(json.dumps(plan.as_dict() | {"deleted": False}, indent=2))
        else:
            print(f"dsbd-chat: cannot delete: {plan.describe()}", file=sys.stderr)
        return 1
    if not a.yes:
        if a.json or not sys.stdin.isatty():
            print(json.dumps(plan.as_dict() | {"deleted": False}, indent=2) if a.json else
                  f"{plan.describe()}\nnothing deleted: pass --yes to delete")
            return 1
        answer = input(f"{plan.describe()}\ndelete? [y/N] ").strip().lower()
        if answer not in ("y", "yes"):
            print("nothing deleted")
            return 1
    freed = library.delete(plan)
    if a.json:
        print(json.dumps(plan.as_dict() | {"deleted": True, "freed": freed}, indent=2))
    else:
        print(f"deleted {plan.entry.name}: {_size(freed)} freed")
    return 0


def _models_show(a) -> int:
    from backends.modelfiles import library

    c = library.card(a.path)
    if a.json:
        print(json.dumps(c.as_dict(), indent=2, default=str))
        return 0
    e = c.entry
    print(f"{e.name}  ({e.path})")
    print(f"  {e.arch} {e.params_label or ''} {e.quant}, context {e.context_length}, {_size(e.size)}, "
          f"{'complete' if e.complete else 'INCOMPLETE: ' + str(e.problem)}, chat template "
          f"{'yes' if c.chat_template else 'no'}, {c.tensors} tensors")
    for k, v in c.metadata.items():
        if k == "tokenizer.chat_template":
            continue
        text = json.dumps(v, ensure_ascii=False, default=str) if not isinstance(v, str) else v
        print(f"  {k} = {text[:160]}")
    return 0



def _worker_rows(endpoints) -> list[dict]:
    if not endpoints:
        return []
    from backends.host import rpc_devices

    return rpc_devices(endpoints)
