"""The README's measured figures and the presets' descriptions, written from the JSON in docs/measurements; and
the README's glossary of the knobs, written from app/config.py's KNOBS (each knob's meaning is stated there once).

    python scripts/figures.py           # rewrites the README's figure regions and assets/presets.json
    python scripts/figures.py --check   # exits 1 and prints the difference where they disagree with the JSON

The README regions sit between `<!-- figures:NAME -->` and `<!-- /figures:NAME -->`. Every figure names the
machine it was measured on: the JSON's own `machine` block, or for older files docs/measurements/machines.json
(taken from the report that describes the run); a file whose machine is unrecorded is not cited. Claim rule: a
speed ratio at a plain mode's law is given only where the mode drafted (drafted iterations > 0) and has that
mode's law; where it drafted nothing the text says "at <mode>'s speed"; a ratio between two laws says so.
"""

from __future__ import annotations

import difflib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.config import KNOBS, DecodeParams  # noqa: E402
from offload.plan import format_bytes  # noqa: E402  (the app's one size format)

MEASURED = ROOT / "docs" / "measurements"
README = ROOT / "README.md"
PRESETS = ROOT / "assets" / "presets.json"

FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX-512-BF16", "amx_tile": "AMX", "asimd": "NEON"}
NAMES = {"beam-sample": "beam sampling", "beam-sample-repl": "beam sampling with replacement", "sample": "sampling"}


def load(name: str) -> dict:
    return json.loads((MEASURED / name).read_text())


def machine(name: str) -> dict:
    """The machine `name` ran on; raises where it is unrecorded (such a figure is not cited)."""
    m = load(name).get("machine") or json.loads((MEASURED / "machines.json").read_text()).get(name)
    if not isinstance(m, dict):
        raise ValueError(f"{name}: machine unrecorded, not cited")
    return m


def on(name: str) -> str:
    """'2-core AMD EPYC, AVX2' (+ GPU), and for a cost profile the projection's label."""
    m = machine(name)
    flags = ", ".join(FLAGS[f] for f in FLAGS if f in m.get("flags", []))
    text = f"{m['cores']}-core {m['cpu']}" + (f", {flags}" if flags else "") + (f", {m['gpu']}" if m.get("gpu") else "")
    if m.get("cost_profile"):
        return (f"projected from published RTX 4090 figures, not run on a GPU: cost profile {m['cost_profile']}, "
                f"the decoder measured on a {text}")
    return f"measured on a {text}"


def law(settings: dict) -> str | None:
    """The plain mode whose output law a mode has (DSBD with W_min = W), else None."""
    mode = settings["mode"]
    if mode in NAMES:
        return mode
    if mode == "dsbd" and settings.get("min_beams") == settings["beams"]:
        return "beam-sample" if settings.get("replacement") == "without" else "beam-sample-repl"
    return None


SAME_SPEED = 0.98  # a ratio at least this close reads "at its speed" (two runs of the same passes differ ~1-2%)


def speed(data: dict, mode: str, ref: str, key: str = "speed_vs") -> str:
    """The speed claim of `mode` against the plain mode `ref`, by the claim rule."""
    s, name = data["summary"][mode], NAMES[ref]
    ratio = f"{s[f'{key}_{ref}']:.2f}x {name}'s speed"
    if law(data["config"]["settings"][mode]) != ref:
        return f"{ratio} (a different law)"
    if s.get("drafted_iterations", 0) > 0:
        return ratio
    # A mode that drafted nothing sped nothing up; where it is slower, that is its figure.
    return f"at {name}'s speed" if s[f"{key}_{ref}"] >= SAME_SPEED else f"{ratio} (it drafted nothing)"


def pct(xs) -> str:
    if max(xs) == 0:
        return "0%"
    fmt = "{:.1f}" if max(xs) < 0.1 else "{:.0f}"
    return span([100 * x for x in xs], fmt) + "%"


def span(xs, fmt: str = "{:.1f}") -> str:
    lo, hi = fmt.format(min(xs)), fmt.format(max(xs))
    return lo if lo == hi else f"{lo}-{hi}"


def link(report: str) -> str:
    return f"[{report}](docs/measurements/{report})"


# ---- the figures, each from one or two JSON files ----

def same_law() -> dict:
    """Best quality vs beam sampling at the same law, CPU (best-quality-same-*.json)."""
    files = ["best-quality-same-code.json", "best-quality-same-chat.json"]
    data = [load(f) for f in files]
    best = [d["summary"]["preset:Best quality"] for d in data]
    same = [tuple(map(int, b["same_answers_as_beam-sample"].split("/"))) for b in best]
    claims = {speed(d, "preset:Best quality", "beam-sample") for d in data}
    assert len({on(f) for f in files}) == 1 and len(claims) == 1
    return {"on": on(files[0]), "claim": claims.pop(), "same": f"{sum(k for k, _ in same)}/{sum(n for _, n in same)}",
            "code": best[0]["runs"], "chat": best[1]["runs"],
            "drafted": pct([b["drafted_iterations"] for b in best]),
            "share_best": pct([b["decoder_share"] for b in best]),
            "share_plain": pct([d["summary"]["beam-sample"]["decoder_share"] for d in data])}


def row_math() -> dict:
    """The compiled default vs the numpy reference per iteration outside the passes (rowmath-draftlayer-epyc.json)."""
    f = "rowmath-draftlayer-epyc.json"
    rows = [r for r in load(f)["results"] if r["rows"] == 4]
    plain = [r for r in rows if r["op"].startswith("plain step")]
    layer = [r for r in rows if r["op"].startswith("verified layer")]
    return {"on": on(f), "plain": span([r["numpy/compiled"] for r in plain]) + "x",
            "layer": span([r["numpy/compiled"] for r in layer]) + "x",
            "plain_ms": span([r["compiled_ms"] for r in plain]), "layer_ms": span([r["compiled_ms"] for r in layer])}


def plain(f: str = "plain-vs-llamacpp-step-epyc.json") -> dict:
    """`sample` against llama.cpp's own loop, on its default context and on the engine's (the qwen-coder target:
    plain-vs-llamacpp-step-epyc.json; the default model: plain-vs-llamacpp-tiny-step-epyc.json)."""
    s = load(f)["summary"]
    return {"on": on(f), "default": f"{s['overall']:.3f}x", "same": f"{s['on_our_context_overall']:.3f}x",
            "context": f"{s['context_cost']:.3f}x"}


FIXED = "preset:Best quality,forest=fixed,draft_beams=8,gamma=3"  # a forest every iteration, at Best quality's law


def projected() -> dict:
    """The presets on the rtx4090-7b cost profile (decoder-exp8-rtx4090-7b-code.json)."""
    f = "decoder-exp8-rtx4090-7b-code.json"
    d = load(f)
    s = d["summary"]
    plain = [r for r in d["runs"] if r["mode"] == "beam-sample"]
    pass_ms = 1e3 * sum(r["projected"]["pass_s"] for r in plain) / sum(r["stats"]["iterations"] for r in plain)
    return {"on": on(f), "profile": machine(f)["cost_profile"],
            "best": speed(d, "preset:Best quality", "beam-sample", "projected_speed_vs"),
            "balanced": speed(d, "preset:Balanced", "beam-sample", "projected_speed_vs"),
            "share": pct([m["projected_decoder_share"] for k, m in s.items() if k != FIXED]),
            "drafted": f"{s['preset:Best quality']['drafted_iterations']:.1%}",
            "forest_ms": f"{s[FIXED]['decoder_ms_per_iteration']:.0f}",
            "passes": f"{s[FIXED]['decoder_ms_per_iteration'] / pass_ms:.0f}"}


def same_texts(f: str, g: str, mode: str | None = None) -> str:
    """'k/n': how many (prompt, mode) answers of run f (only `mode`'s, if given) run g returned with the same text."""
    texts = [{(r["prompt"], r["mode"]): r["text"] for r in load(x)["runs"] if mode in (None, r["mode"])}
             for x in (f, g)]
    return f"{sum(texts[0][k] == texts[1].get(k) for k in texts[0])}/{len(texts[0])}"


def heads(f: str = "heads-before-rtx4090-7b-code.json", g: str = "heads-after-rtx4090-7b-code.json") -> dict:
    """A fixed forest's decoder before and after a change, one session: heads cut on the device and the draft's
    rows read in place (heads-*-rtx4090-7b-code.json); the draft layer's compiled draws and likeliest pairs and the
    beams normalised where they lie (draftlayer-*-rtx4090-7b-code.json)."""
    b, a = load(f)["summary"][FIXED], load(g)["summary"][FIXED]
    return {"on": on(f).split("the decoder measured on a ")[-1], "before": f"{b['decoder_ms_per_iteration']:.1f}",
            "after": f"{a['decoder_ms_per_iteration']:.1f}", "same": same_texts(f, g),
            "proj_before": f"{b['projected_speed_vs_beam-sample']:.2f}x",
            "proj_after": f"{a['projected_speed_vs_beam-sample']:.2f}x"}


def exp_lanes() -> dict:
    """The decoder before and after the exponentials ran 8 lanes wide on AVX2, one session, alternating
    (exp8-*-rtx4090-7b-code.json): beam sampling, Best quality and the fixed forest."""
    f, g = "exp8-before-rtx4090-7b-code.json", "exp8-after-rtx4090-7b-code.json"
    b, a = load(f)["summary"], load(g)["summary"]
    ms = {m: f"{b[m]['decoder_ms_per_iteration']:.2f} / {a[m]['decoder_ms_per_iteration']:.2f}"
          for m in ("beam-sample", "preset:Best quality", FIXED)}
    return {"on": on(f).split("the decoder measured on a ")[-1], "same": same_texts(f, g), "ms": ms}


def in_place() -> dict:
    """A fixed forest's decoder before and after a pass's rows were read in place, one session
    (inplace-before-rtx4090-7b-code.json, rowmath-projected-rtx4090-7b-code.json)."""
    f, g = "inplace-before-rtx4090-7b-code.json", "rowmath-projected-rtx4090-7b-code.json"
    b, a = load(f)["summary"][FIXED], load(g)["summary"][FIXED]
    return {"on": on(f).split("the decoder measured on a ")[-1], "before": f"{b['decoder_ms_per_iteration']:.1f}",
            "after": f"{a['decoder_ms_per_iteration']:.1f}", "same": same_texts(f, g, FIXED),
            "proj_before": f"{b['projected_speed_vs_beam-sample']:.2f}x",
            "proj_after": f"{a['projected_speed_vs_beam-sample']:.2f}x", "steps": f"{a['steps_per_target_pass']:.2f}"}


def busy() -> dict:
    r = {str(x["threads"]): x for x in load("busy.json")["results"]}
    pinned = next(k for k in r if k != "auto")
    return {"on": on("busy.json"), "auto": f"{r['auto']['busy_speed_vs_idle']:.2f}x",
            "pinned": f"{r[pinned]['busy_speed_vs_idle']:.2f}x", "threads": pinned}


def unique_paths() -> dict:
    out = {}
    for suite in ("chat", "code"):
        f = f"qwen-cache-{suite}.json"
        d = load(f)
        out[suite] = d["summary"]["dsbd:min_beams=4"]
        out["on"], out["base"] = on(f), d["config"]["base"]
        if suite == "code":
            out["repl"] = d["summary"]["beam-sample-repl"]
    return out


def pass_cost() -> dict:
    f = "qwen-pass-cost-llamacpp-t2.json"
    s = load(f)["seconds"]
    return {"on": on(f), "ratio": s["19"] / s["1"], "ms19": 1000 * s["19"], "ms1": 1000 * s["1"]}


def draft_cost() -> dict:
    f = "draft-cost.json"
    d = load(f)
    s = d["seconds"]
    return {"on": on(f), "ratio": span([s["q4_0-head"][n] / s["none"][n] for n in ("4", "5")], "{:.2f}") + "x",
            "before": d["overlap"]["none"], "after": d["overlap"]["q4_0-head"]}


def edits() -> dict:
    """Balanced vs sampling on the edit suite with files, the target alone and with the draft
    (edit-files-qwen-target.json, edit-files-qwen-pair.json)."""
    files = {"target": "edit-files-qwen-target.json", "pair": "edit-files-qwen-pair.json"}
    data = {k: load(f) for k, f in files.items()}
    assert len({on(f) for f in files.values()}) == 1
    out = {"on": on(files["target"]), "tasks": data["target"]["summary"]["sample"]["runs"]}
    for k, d in data.items():
        s = d["summary"]["preset:Balanced"]
        out[k] = speed(d, "preset:Balanced", "sample", "overall_speed_vs").removesuffix(" (a different law)")
        assert law(d["config"]["settings"]["preset:Balanced"]) != "sample"  # the texts say so once
        out[f"{k}_steps"] = f"{s['steps_per_target_pass']:.1f}"
    return out


def learnt_costs() -> dict:
    d = load("learnt-costs.json")
    return {"on": on("learnt-costs.json"), "timed": f"{d['mean_error_timed']:.1%}",
            "learnt": f"{d['mean_error_learnt']:.1%}", "answers": len(d["answers"]) - 1}


def attachments() -> dict:
    return {"on": on("attachments.json")} | load("attachments.json")


def first_start() -> dict:
    return {"on": on("first-start.json")} | load("first-start.json")


def first_answer() -> dict:
    d = load("first-answer.json")
    before, after = d["arms"]["before"]["median"], d["arms"]["after"]["median"]
    loads = [after[p]["load_s"] for p in after]
    prepared = load("first-answer-prepared.json")["arms"]
    return {"on": on("first-answer.json"), "load_before": before["0.0"]["load_s"], "load_after": min(loads),
            "load_after_max": max(loads), "paused_before": before["3.0"]["first_answer_s"],
            "paused_after": after["3.0"]["first_answer_s"],
            "unprepared": prepared["no prepare"]["median"]["3.0"]["first_answer_s"],
            "prepared": prepared["prepare"]["median"]["3.0"]["first_answer_s"]}


# ---- the texts ----

def expect() -> str:
    a, p, e = same_law(), projected(), edits()
    return f"""- **CPU** ({a['on']}, qwen-coder): Best quality has beam sampling's exact law; it
  drafted in {a['drafted']} of iterations and returned beam sampling's answer token for token on {a['same']}
  prompts, {a['claim']} (the decoder is {a['share_best']} of its time, {a['share_plain']} for beam sampling).
- **Edits of attached files** ({e['on']}, qwen-coder, {e['tasks']} tasks): Balanced (one beam carried between
  iterations, a different law from sampling's) copies the file through model-free lookup chains, {e['target_steps']}
  beam steps per target pass: {e['target']} without the draft model, {e['pair']} with it
  ({link('attachments.md')}).
- **GPU** ({p['on']}): on the 7B-class curve
  Best quality {p['best']}, Balanced {p['balanced']}: the decoder's row math still runs on the CPU
  in these projections and is {p['share']} of the projected time (a forest of 8 drafts x 3 layers costs it
  {p['forest_ms']} ms an iteration, about {p['passes']} passes), so Best quality builds a draft-model forest in only
  {p['drafted']} of its iterations there
  ({link('rowmath.md')}).
- **Default model**: SmolLM2-135M, a smoke test; `pip install -e '.[qwen-coder]'` (1.5B + 0.5B) for real answers.
"""


def table() -> str:
    a, r, p, b, u, c, dc, fs, f, e = (same_law(), row_math(), projected(), busy(), unique_paths(), pass_cost(),
                                      draft_cost(), first_start(), attachments(), edits())
    lc, pl, ip, hd, fa, x8 = learnt_costs(), plain(), in_place(), heads(), first_answer(), exp_lanes()
    dl = heads("draftlayer-before-rtx4090-7b-code.json", "draftlayer-after-rtx4090-7b-code.json")
    pt = plain("plain-vs-llamacpp-tiny-step-epyc.json")
    base = u["base"]
    rows = [
        (f"Best quality vs beam sampling at the same law, qwen-coder, {a['code']} code + {a['chat']} chat prompts",
         a["on"],
         f"the same answer token for token on {a['same']} prompts; drafted in {a['drafted']} of iterations, so "
         f"{a['claim']}; the decoder {a['share_best']} of the time ({a['share_plain']} for beam sampling)",
         "rowmath.md"),
        ("Row math per iteration outside the passes, 4 x 151,936 rows, the compiled default vs the numpy reference",
         r["on"],
         f"plain steps {r['plain']}, a verified layer {r['layer']} cheaper ({r['plain_ms']} ms and "
         f"{r['layer_ms']} ms)", "rowmath.md"),
        ("`sample` vs llama.cpp's own generation loop, the same file and threads, qwen-coder target", pl["on"],
         f"{pl['default']} its speed on llama.cpp's default context, {pl['same']} on the context dsbd-chat makes "
         f"(which runs llama.cpp's loop at {pl['context']} its default-context speed: the f32 cache and plain "
         "attention that exact forests need)", "rowmath.md"),
        ("`sample` vs llama.cpp's own generation loop, the same file and threads, the default model (tiny)",
         pt["on"], f"{pt['default']} its speed on llama.cpp's default context, {pt['same']} on the context dsbd-chat "
         f"makes (which runs llama.cpp's loop at {pt['context']}): on a token of about 8 ms the engine's own "
         "quarter of a millisecond is within noise; what is left is the f32 cache exact forests need", "rowmath.md"),
        ("Presets on the 7B-class curve, qwen-coder, code suite", p["on"],
         f"Best quality {p['best']}, Balanced {p['balanced']}; the CPU-side decoder is {p['share']} of the "
         "projected time", "rowmath.md"),
        ("A forest's decoder time, fixed W_S 8 x gamma 3 at Best quality's law, qwen-coder, code suite: before / "
         "after its pass's rows were read in place", ip["on"],
         f"{ip['before']} / {ip['after']} ms an iteration, the same answers ({ip['same']}); projected on the 7B-class "
         f"curve {ip['proj_before']} / {ip['proj_after']} beam sampling's speed at {ip['steps']} beam steps a pass",
         "rowmath.md"),
        ("The same forest's decoder time: before / after a head's cut on the device (top-k, the likeliest pairs) "
         "and the draft's rows read in place", hd["on"],
         f"{hd['before']} / {hd['after']} ms an iteration, the same answers ({hd['same']} texts of every mode); "
         f"projected on the 7B-class curve {hd['proj_before']} / {hd['proj_after']} beam sampling's speed",
         "rowmath.md"),
        ("The same forest's decoder time: before / after the draft layer's draws and likeliest pairs in one compiled "
         "call each and the beams normalised where the pass left them", dl["on"],
         f"{dl['before']} / {dl['after']} ms an iteration, the same answers ({dl['same']} texts of every mode); "
         f"projected on the 7B-class curve {dl['proj_before']} / {dl['proj_after']} beam sampling's speed",
         "rowmath.md"),
        ("The decoder's time: before / after the exponentials run 8 lanes wide (a float32-only loop, the float64 "
         "block sums after it), qwen-coder, code suite", x8["on"],
         f"beam sampling {x8['ms']['beam-sample']}, Best quality {x8['ms']['preset:Best quality']}, the fixed "
         f"W_S 8 x gamma 3 forest {x8['ms'][FIXED]} ms an iteration; the same answers ({x8['same']} texts)",
         "rowmath.md"),
        ("Balanced vs sampling on edits of attached files, qwen-coder, the target alone / with the draft",
         e["on"], f"{e['target']} / {e['pair']} (a different law); {e['target_steps']} / {e['pair_steps']} beam steps "
         "per target pass",
         "attachments.md"),
        ("One-token passes beside a busy core vs idle, qwen-coder target", b["on"],
         f"{b['auto']} the idle speed with auto threads, {b['pinned']} with {b['threads']} pinned", "rowmath.md"),
        (f"Unique paths: tokens a forest pass computes (fixed DSBD, W {base['beams']}, gamma {base['gamma']})",
         u["on"], f"{u['chat']['distinct_tokens_per_pass']:.1f} of {u['chat']['query_tokens_per_pass']:.1f} (chat), "
         f"{u['code']['distinct_tokens_per_pass']:.1f} of {u['code']['query_tokens_per_pass']:.1f} (code); "
         f"beam-sample-repl {u['repl']['distinct_tokens_per_pass']:.1f} of "
         f"{u['repl']['query_tokens_per_pass']:.1f} (code)", "forest-cache.md"),
        ("One pass scoring 19 tokens vs 1, qwen target, llama.cpp, 2 threads", c["on"],
         f"{c['ratio']:.1f}x the time ({c['ms19']:.0f} vs {c['ms1']:.0f} ms)", "pass-cost.md"),
        ("Predicting an answer's passes, qwen target, Balanced: the curve learnt from earlier answers vs the timed "
         "one", lc["on"], f"{lc['learnt']} vs {lc['timed']} mean error over {lc['answers']} answers", "pass-cost.md"),
        ("Requantized draft (`--draft-quant q4_0-head`, qwen-coder)", dc["on"],
         f"{dc['ratio']} the draft pass cost at 4-5 tokens, acceptance proxy {dc['before']:.3f} -> "
         f"{dc['after']:.3f}", "draft-cost.md"),
        (f"A {format_bytes(f['bytes'])} attachment ({f['tokens']:,} tokens): the match source's prompt index", f["on"],
         f"{f['match_index_s']:.3f} s (the plain n-gram table {f['match_index_plain_s']:.3f} s in the same run); "
         f"tokenizing it {f['tokenize_s']:.3f} s, retrieving passages {f['retrieval_s']:.2f} s", "attachments.md"),
        ("Loading the qwen-coder pair (files assembled, a fresh process), and the first answer after a 3 s pause: "
         "before / after the load skipped torch's VRAM query, compared vocabularies by fingerprint and kept headers",
         fa["on"], f"load {fa['load_before']:.2f} / {fa['load_after']:.2f}-{fa['load_after_max']:.2f} s; first answer "
         f"{fa['paused_before']:.2f} / {fa['paused_after']:.2f} s, and {fa['prepared']:.2f} s (against "
         f"{fa['unprepared']:.2f} s in the same session) with the contexts made after the load, as the app does",
         "load-progress.md"),
        ("Fresh install (before the RPC build flag) and first answer", fs["on"],
         f"{fs['install_s'] / 60:.1f} min install; page at {fs['first_page_s']:.1f} s, first answer "
         f"{fs['first_answer_s']:.1f} s after launch", "first-start.md"),
    ]
    lines = ["| what | machine | result | report |", "|---|---|---|---|"]
    lines += [f"| {w} | {m.removeprefix('measured on a ')} | {res} | {link(rep)} |" for w, m, res, rep in rows]
    return "\n".join(lines) + "\n"


def knobs() -> str:
    """The glossary of the knobs: flag, meaning (with what only the README adds) and default, from KNOBS."""
    defaults = DecodeParams()
    lines = ["| knob | CLI flag | meaning | default |", "|---|---|---|---|"]
    for field, k in KNOBS.items():
        arg = k.arg or "|".join(k.choices or ())
        flag = f"`{k.flag}{' ' + arg if arg else ''}`" + (f" {k.note}" if k.note else "")
        meaning = f"{k.meaning}. {k.more}" if k.more else k.meaning
        default = k.default
        if default is None:
            value = getattr(defaults, field)
            default = ",".join(value) if isinstance(value, tuple) else str(value)
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in (k.name, flag, meaning, default)) + " |")
    return "\n".join(lines) + "\n"


# The presets' descriptions: settings figures from the preset itself, measured ones from the JSON.
DESCRIPTIONS = {
    "Fast": "dsbd-mem, {beams} beams, forest sized per iteration: one beam carried between iterations, the smallest "
            "KV cache",
    "Balanced": "dsbd-mem, {beams} beams, forest sized per iteration: one beam carried between iterations "
                "(README: Presets)",
    "Best quality": "dsbd without replacement, {beams} beams at every step: exactly conventional beam sampling's "
                    "law (beam-sample), up to {draft_beams} drafts per layer, forest sized per iteration; "
                    "{claim} ({on})",
}


def presets() -> str:
    data = json.loads(PRESETS.read_text())
    a = same_law()
    for name, text in DESCRIPTIONS.items():
        data[name]["description"] = text.format(**data[name]["settings"], claim=a["claim"], on=a["on"])
    return json.dumps(data, indent=2) + "\n"


def render_readme(text: str) -> str:
    for name, body in (("expect", expect()), ("table", table()), ("knobs", knobs())):
        pattern = re.compile(rf"(<!-- figures:{name} -->\n).*?(<!-- /figures:{name} -->)", re.S)
        if not pattern.search(text):
            raise ValueError(f"README.md has no figures:{name} region")
        text = pattern.sub(lambda m: m.group(1) + body + m.group(2), text)
    return text


def differences() -> str:
    """The unified diff between the files as they are and as the JSON writes them ('' when they agree)."""
    out = []
    for path, new in ((README, render_readme(README.read_text())), (PRESETS, presets())):
        old = path.read_text()
        rel = str(path.relative_to(ROOT))
        out += difflib.unified_diff(old.splitlines(True), new.splitlines(True), rel, rel + " (from the JSON)")
    return "".join(out)


def main(argv: list[str]) -> int:
    if "--check" in argv:
        diff = differences()
        if diff:
            print(diff + "\nrun: python scripts/figures.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(render_readme(README.read_text()))
    PRESETS.write_text(presets())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
