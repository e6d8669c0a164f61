"""Compare tab: blind side-by-side rating of decoding modes, prompt sets in the background, saved results
and a quality report.

Blind (the default): one prompt, two or more modes, all with the same seed, answered one after another
(the engine runs one generation at a time) and shown as they finish under labels A, B, ... in a random
order. Nothing in the page names a mode until the vote; the label -> mode map stays on the server. Each
mode reuses the decoding panel's settings with only the mode swapped, so a comparison varies one thing.
An answer that rewrites a prompt-set item's attached file shows its unified diff, as the chat does.
Records, the store, tallies and the runner live in app/compare/, the report in app/compare/report.py.
"""

from __future__ import annotations

import random
import threading
import time
from html import escape
from pathlib import Path
from typing import Iterator

import gradio as gr
from matplotlib.figure import Figure

from app import attachments as att
from app.config import MODES, ConfigError
from app.engine.interface import NoModelLoaded
from app.compare.records import (BOTH_BAD, TIE, ResultsError, load_prompt_source, needs_vote, new_comparison, new_run,
                                 parse_prompts)
from app.compare.runner import SetRunner, generate_answer, iter_answers, open_run
from app.compare.store import ResultStore, read_export
from app.serve.ui.chat import ENGINE_QUEUE, Session
from app.serve.ui.settings import params_from, settings_from_values

DEFAULT_MODES = ["greedy", "beam", "dsbd"]
SOURCES = ("chat suite", "code suite", "files suite", "paste", "upload")
SUITES = {"chat suite": "chat", "code suite": "code", "files suite": "edit-files"}  # packaged prompt sets
_VOTE_NAMES = {TIE: "Tie", BOTH_BAD: "Both bad"}
UPLOAD_LABEL = 'Prompt file: .jsonl (a JSON string or {"prompt": …} per line), .txt (one per line)'


def run_one(engine, messages: list[dict], settings: dict, mode: str, cancel: threading.Event) -> dict:
    """Run `mode` to the end; {mode, text, stats, error}."""
    try:
        params = params_from(settings | {"mode": mode})
    except (ConfigError, ValueError) as e:
        return {"mode": mode, "text": "", "stats": {}, "error": str(e)}
    return {"mode": mode} | generate_answer(engine, messages, params, cancel)


def _fmt(v, spec: str) -> str:
    return f"{v:{spec}}" if isinstance(v, (int, float)) else "–"


def _stats_line(st: dict) -> str:
    return (f'<div class="dsbd-card-stats">{_fmt(st.get("tokens_per_s"), ".1f")} tok/s · '
            f'{st.get("target_passes", "–")} target passes · '
            f'mean log-p {_fmt(st.get("mean_target_logprob"), ".3f")}</div>')


def diffs_html(text: str, files: list[att.Attachment]) -> str:
    """The unified diff of each attached file the answer rewrites (a fenced block like it), as the chat shows it."""
    out = []
    for d in att.diffs(text, files) if files else []:
        lines = "".join(f'<span class="dsbd-diff-{_DIFF_CLASS.get(line[:1], "same")}">{escape(line)}</span>'
                        for line in d.diff.splitlines(keepends=True))
        out.append(f'<details class="dsbd-card-diff" open><summary>Changes to <code>{escape(d.name)}</code> '
                   f'(+{d.added} −{d.removed})</summary><pre>{lines}</pre></details>')
    return "".join(out)


_DIFF_CLASS = {"+": "add", "-": "del", "@": "hunk"}


def _text_html(a: dict, files: list[att.Attachment]) -> str:
    return f'<div class="dsbd-card-text">{escape(a["text"]) or "<i>(empty)</i>"}</div>{diffs_html(a["text"], files)}'


def cards_html(results: list[dict], pending: list[str] = (), *, winner: str | None = None,
               files: list[att.Attachment] = ()) -> str:
    """Revealed cards: label (if any) and mode, headline numbers, text and the diffs of the `files` it rewrites;
    placeholders for modes still to run."""
    cards = []
    for r in results:
        st = r.get("stats") or {}
        if r.get("error"):
            body = f'<div class="dsbd-card-error">⚠️ {escape(r["error"])}</div>'
        else:
            body = _text_html(r, files)
        head = (f'{escape(r["label"])} = ' if r.get("label") else "") + escape(r["mode"])
        if r.get("passed") is not None:
            head += " · tests " + ("passed ✅" if r["passed"] else "failed ❌")
        won = winner is not None and r.get("label") == winner
        cls = "dsbd-card dsbd-card-winner" if won else "dsbd-card"
        cards.append(f'<div class="{cls}"><div class="dsbd-card-mode">{head}{" · your pick" if won else ""}</div>'
                     f'{_stats_line(st)}{body}</div>')
    for m in pending:
        cards.append(f'<div class="dsbd-card dsbd-card-pending"><div class="dsbd-card-mode">{escape(m)}</div>'
                     '<div class="dsbd-card-stats">waiting…</div></div>')
    return f'<div class="dsbd-cards">{"".join(cards)}</div>'


def blind_cards_html(rec: dict, done: int, *, writing: bool = True) -> str:
    """Cards under neutral labels only: finished answers' text (and diffs), the one being written, the queue.
    No mode, no stats, no error text (an error message may name its mode) until the vote."""
    cards, files = [], att.task_files(rec.get("task"))
    for i, a in enumerate(rec["answers"]):
        label = f'<div class="dsbd-card-mode">Answer {escape(a["label"])}</div>'
        if i < done:
            body = ('<div class="dsbd-card-error">⚠️ this answer failed; the reason is shown after the vote</div>'
                    if a.get("error") else _text_html(a, files))
            cards.append(f'<div class="dsbd-card">{label}{body}</div>')
        else:
            state = "writing…" if writing and i == done else f"queued ({i - done + (not writing)} to go)" \
                if writing else "not run"
            cards.append(f'<div class="dsbd-card dsbd-card-pending">{label}'
                         f'<div class="dsbd-card-stats">{state}</div></div>')
    return f'<div class="dsbd-cards">{"".join(cards)}</div>'


def revealed_html(rec: dict) -> str:
    vote = rec.get("vote") or {}
    return cards_html(rec["answers"], winner=vote.get("choice"), files=att.task_files(rec.get("task")))


def record_html(rec: dict) -> str:
    """A saved comparison's answers: blind while it waits for a vote, else with modes, stats and tests."""
    return blind_cards_html(rec, len(rec["answers"])) if needs_vote(rec) else revealed_html(rec)


def scatter(results: list[dict]) -> Figure | None:
    """Speed (tokens/s) against quality (mean target log-prob per token), one labelled point per mode."""
    pts = [(r["mode"], (r.get("stats") or {}).get("tokens_per_s"), (r.get("stats") or {}).get("mean_target_logprob"))
           for r in results if not r.get("error")]
    pts = [(m, x, y) for m, x, y in pts if isinstance(x, (int, float)) and isinstance(y, (int, float))]
    if not pts:
        return None
    fig = Figure(figsize=(5.2, 3.4), dpi=100)  # no pyplot: thread-safe, no global figure registry
    ax = fig.add_subplot()
    for m, x, y in pts:
        ax.scatter([x], [y], s=46)
        ax.annotate(m, (x, y), textcoords="offset points", xytext=(6, 4), fontsize=9)
    ax.set_xlabel("speed: tokens / s")
    ax.set_ylabel("quality: mean target log-prob")
    ax.margins(x=0.2, y=0.2)  # room for the labels
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _vote_choices(rec: dict) -> list[tuple[str, str]]:
    return [(f"{a['label']} is better", a["label"]) for a in rec["answers"]] + \
        [(_VOTE_NAMES[TIE], TIE), (_VOTE_NAMES[BOTH_BAD], BOTH_BAD)]


def _hidden_vote() -> tuple:
    return gr.update(visible=False, value=None), gr.update(visible=False)


def _question(rec: dict) -> str:
    """What was asked: a task's own prompt (the record's prompt starts with the task's files)."""
    return (rec.get("task") or {}).get("prompt") or rec["prompt"]


def _progress_html(done: int, total: int, state: str) -> str:
    return (f'<div id="compare-set-bar"><progress value="{done}" max="{max(total, 1)}" style="width:100%">'
            f"</progress><div>{done} / {total} prompts · {escape(state)}</div></div>")


class CompareUI:
    """Handlers of the Compare tab over one engine and one result store (beside the chat history)."""

    def __init__(self, engine, store: ResultStore, *, rng: random.Random | None = None) -> None:
        self.engine, self.store = engine, store
        self.rng = rng or random.Random()  # the blind order; tests pass a seeded one
        self.runner = SetRunner(engine, store)

    # -- one prompt ---------------------------------------------------------------------------------
    def _check(self, settings: dict, modes: list[str]) -> tuple[dict, list[str]]:
        """Params per mode that can run here, and a message per mode that cannot (shown openly: before
        the answers exist, naming a mode gives nothing away)."""
        params, problems = {}, []
        for m in modes:
            try:
                params[m] = self.engine.check_params(params_from(settings | {"mode": m}))
            except (ConfigError, ValueError) as e:
                problems.append(f"{m} cannot run here: {e}")
        return params, problems

    def run(self, session: Session, prompt: str, modes: list[str], blind: bool, system: str, *values,
            progress=gr.Progress()) -> Iterator[tuple]:  # noqa: B008 (how Gradio injects its progress bar)
        """Yield (cards html, plot, status, vote radio, vote button) as the answers arrive."""
        prompt, modes = (prompt or "").strip(), [m for m in MODES if m in (modes or [])]
        if not prompt or not modes:
            yield gr.skip(), gr.skip(), "Enter a prompt and pick at least one mode.", *_hidden_vote()
            return
        if blind and len(modes) < 2:
            yield gr.skip(), gr.skip(), "A blind comparison needs at least two modes.", *_hidden_vote()
            return
        try:
            self.engine.describe()
        except NoModelLoaded as e:  # unloaded in the Models tab
            yield gr.skip(), gr.skip(), f"{e}.", *_hidden_vote()
            return
        settings = settings_from_values(*values)
        session.cancel = cancel = threading.Event()  # the Stop button of this tab stops the comparison too
        session.compare = None
        yield from (self._blind if blind else self._open)(session, prompt, modes, system or "", settings, cancel,
                                                         progress)

    def _seed(self, settings: dict) -> int:
        seed = settings.get("seed")
        return int(seed) if isinstance(seed, (int, float)) and seed >= 0 else self.rng.randrange(2**31)

    def _blind(self, session, prompt, modes, system, settings, cancel, progress) -> Iterator[tuple]:
        params, problems = self._check(settings, modes)
        note = (" " + "; ".join(problems) + ".") if problems else ""
        if len(params) < 2:
            yield gr.skip(), gr.skip(), f"Need two modes that can run.{note}", *_hidden_vote()
            return
        rec = new_comparison(prompt=prompt, modes=list(params), seed=self._seed(settings), settings=settings,
                             models=self.engine.describe(), system=system, kind="blind", rng=self.rng)
        n, t0 = len(rec["answers"]), time.perf_counter()
        seed_note = f"Seed {rec['seed']} for every answer."
        done = 0
        for i, finished in iter_answers(self.engine, rec, params, cancel=cancel):  # label order, streamed
            if finished:
                done = i + 1
                continue
            progress((i, n), desc=f"answer {rec['answers'][i]['label']} ({i + 1}/{n})")
            yield (blind_cards_html(rec, i), None, f"Writing answer {rec['answers'][i]['label']} ({i + 1}/{n}). "
                   f"{seed_note}{note}", *_hidden_vote())
        if done < n:
            yield (blind_cards_html(rec, done, writing=False), None,
                   f"Stopped after {done} of {n} answers; nothing was saved.", *_hidden_vote())
            return
        self.store.save(rec)  # pending until the vote: the Results view can bring it back
        session.compare = rec
        progress((n, n), desc="done")
        yield (blind_cards_html(rec, n), None,
               f"Done: {n} answers in {time.perf_counter() - t0:.1f} s. {seed_note} Which is better? "
               f"Your vote reveals the modes and their stats.{note}",
               gr.update(choices=_vote_choices(rec), value=None, visible=True), gr.update(visible=True))

    def _open(self, session, prompt, modes, system, settings, cancel, progress) -> Iterator[tuple]:
        """Labelled comparison (blind off): modes and stats shown at once; saved, no vote asked."""
        seed = self._seed(settings)
        messages = ([{"role": "system", "content": system}] if system.strip() else []) + \
            [{"role": "user", "content": prompt}]
        results: list[dict] = []
        t0 = time.perf_counter()
        for i, mode in enumerate(modes):
            if cancel.is_set():
                break
            progress((i, len(modes)), desc=f"{mode} ({i + 1}/{len(modes)})")
            yield cards_html(results, modes[i:]), gr.skip(), f"Running {mode} ({i + 1}/{len(modes)})…", \
                *_hidden_vote()
            results.append(run_one(self.engine, messages, settings | {"seed": seed}, mode, cancel))
        progress((len(results), len(modes)), desc="done")
        stopped = cancel.is_set()
        if results and not stopped:
            rec = new_comparison(prompt=prompt, modes=[r["mode"] for r in results], seed=seed, settings=settings,
                                 models=self.engine.describe(), system=system, kind="open",
                                 rng=random.Random(0))
            by_mode = {r["mode"]: r for r in results}
            for a in rec["answers"]:
                a |= {k: by_mode[a["mode"]][k] for k in ("text", "stats", "error")}
            self.store.save(rec)
        yield (cards_html(results, modes[len(results):] if stopped else []), scatter(results),
               f"{'Stopped' if stopped else 'Done'}: {len(results)} mode(s) in {time.perf_counter() - t0:.1f} s "
               f"(seed {seed} for every mode).", *_hidden_vote())

    def vote(self, session: Session, choice: str | None) -> tuple:
        """Save the vote, then reveal: (cards, plot, status, vote radio, vote button)."""
        rec = getattr(session, "compare", None)
        if rec is None:
            return gr.skip(), gr.skip(), "Nothing to vote on: run a comparison first.", *_hidden_vote()
        if not choice:
            return gr.skip(), gr.skip(), "Pick an answer (or Tie / Both bad) first.", gr.skip(), gr.skip()
        try:
            rec = self.store.vote(rec["id"], choice)
        except (ResultsError, ValueError) as e:
            return gr.skip(), gr.skip(), f"Vote not saved: {e}", gr.skip(), gr.skip()
        session.compare = None
        modes = ", ".join(f"{a['label']} = {a['mode']}" for a in rec["answers"])
        verdict = f"{choice} ({rec['vote']['winner']}) wins" if rec["vote"]["winner"] else _VOTE_NAMES[choice]
        left = len(self.store.pending())
        return (revealed_html(rec), scatter(rec["answers"]),
                f"Vote saved: {verdict}. {modes}. " + (f"{left} comparison(s) still wait for a vote." if left else ""),
                *_hidden_vote())

    def next_pending(self, session: Session) -> tuple:
        """Bring back the oldest comparison still waiting for a vote (a prompt-set item, or one left unvoted)."""
        pending = self.store.pending()
        if not pending:
            session.compare = None
            return gr.skip(), gr.skip(), "No comparison waits for a vote.", *_hidden_vote()
        rec = session.compare = pending[0]
        n = len(rec["answers"])
        return (blind_cards_html(rec, n), None,
                f"Prompt: {escape(rec['prompt'][:300])} · seed {rec['seed']} for every answer · "
                f"{len(pending)} waiting. Which is better?",
                gr.update(choices=_vote_choices(rec), value=None, visible=True), gr.update(visible=True))

    # -- prompt sets ----------------------------------------------------------------------------------
    def _items(self, source: str, pasted: str, upload) -> tuple[str, list]:
        if source in SUITES:
            return SUITES[source], load_prompt_source(SUITES[source])
        if source == "paste":
            return "pasted", parse_prompts(pasted or "", name="pasted text")
        if not upload:
            raise ConfigError("upload a .jsonl or .txt file of prompts first")
        path = Path(upload if isinstance(upload, str) else upload.name)
        return f"file {path.name}", load_prompt_source(str(path)) if path.suffix == ".json" else \
            parse_prompts(path.read_text(encoding="utf-8"), name=path.name)

    def set_start(self, source: str, pasted: str, upload, limit, modes: list[str], system: str, *values) -> tuple:
        """Start a prompt set in the background: (progress html, status, timer)."""
        try:
            name, items = self._items(source, pasted, upload)
            limit = int(limit or 0)
            items = items[:limit] if limit > 0 else items
            settings = settings_from_values(*values)
            modes = [m for m in MODES if m in (modes or [])]
            params, problems = self._check(settings, modes)
            if problems:
                raise ConfigError("; ".join(problems))
            modes = list(params)
            seed = settings.get("seed")
            run = new_run(source=name, items=items, params=params, settings=settings, models=self.engine.describe(),
                          seed=int(seed) if isinstance(seed, (int, float)) and seed >= 0 else None, system=system or "")
            self.runner.start(run, params)
        except (ConfigError, ResultsError, ValueError, OSError, NoModelLoaded) as e:
            return gr.skip(), f"Not started: {e}", gr.skip()
        return (_progress_html(0, len(items), "running"),
                f"Running {len(items)} prompts × {len(modes)} modes in the background (run {run['id']}).",
                gr.Timer(active=True))

    def set_stop(self) -> str:
        if not self.runner.running:
            return "No prompt set is running."
        self.runner.stop()
        return "Stopping after the answer in progress…"

    def set_resume(self, run_id: str | None) -> tuple:
        """Resume a stopped run where it left off, with the settings it started with."""
        try:
            if not run_id:
                raise ResultsError("pick a stopped run to resume")
            self.runner.start(*open_run(self.store, run_id))
        except (ConfigError, ResultsError, ValueError) as e:
            return gr.skip(), f"Not resumed: {e}", gr.skip()
        done, total, _ = self.runner.progress()
        return _progress_html(done, total, "running"), f"Resumed run {run_id} at {done} / {total}.", \
            gr.Timer(active=True)

    def set_tick(self) -> tuple:
        """Timer: (progress html, status, timer, runs) while the run goes; the timer stops itself at the end."""
        done, total, state = self.runner.progress()
        if self.runner.running:
            return _progress_html(done, total, state), gr.skip(), gr.skip(), gr.skip()
        run = self.runner.run or {}
        graded = run.get("items") and isinstance(run["items"][0], dict)
        end = {"done": "Finished. " + ("Pass rates are in Results." if graded else
                                       "The answers wait for your blind votes: 'Vote on the next pending'."),
               "stopped": "Stopped; resume it from the list.",
               "failed": f"Failed: {run.get('error')}"}.get(state, "")
        return _progress_html(done, total, state), end, gr.Timer(active=False), self.run_choices()

    def run_choices(self) -> dict:
        runs = [r for r in self.store.list_runs() if r.get("state") != "done"]
        choices = [(f"{r['id']} · {r['source']} · {len(r['done'])}/{len(r['items'])} · {r['state']}", r["id"])
                   for r in runs]
        return gr.update(choices=choices, value=choices[0][1] if choices else None)

    # -- results ------------------------------------------------------------------------------------
    def results_view(self) -> tuple:
        """(summary markdown, per-mode table, pair table, recent comparisons, runs dropdown)."""
        from app.compare.report import mode_table_html, pair_table_html

        records = self.store.list()
        pending = sum(needs_vote(r) for r in records)
        notices = "".join(f"\n\n⚠️ {n}" for n in self.store.notices)
        head = (f"**{len(records)}** saved comparisons, **{sum(1 for r in records if r.get('vote'))}** voted, "
                f"**{pending}** waiting for a vote. Saved in `{self.store.dir}`.{notices}")
        rows = []
        for r in reversed(records[-30:]):
            vote = r.get("vote")
            verdict = "waiting" if needs_vote(r) else "–" if not vote else \
                (f"{vote['choice']} = {vote['winner']}" if vote["winner"] else vote["choice"])
            modes = ", ".join(a["mode"] for a in r["answers"]) if not needs_vote(r) else "(hidden until the vote)"
            rows.append(f"<tr><td>{time.strftime('%m-%d %H:%M', time.localtime(r['created']))}</td>"
                        f"<td>{escape(_question(r)[:80])}</td><td>{escape(modes)}</td><td>{escape(verdict)}</td></tr>")
        listing = ('<table class="dsbd-results"><tr><th>when</th><th>prompt</th><th>modes</th><th>vote</th></tr>'
                   f"{''.join(rows)}</table>")
        return head, mode_table_html(records), pair_table_html(records), listing, self.run_choices()

    def saved_choices(self) -> dict:
        """The Show list: the latest saved comparisons, newest first."""
        choices = [(f"{time.strftime('%m-%d %H:%M', time.localtime(r['created']))} · {_question(r)[:70]}", r["id"])
                   for r in reversed(self.store.list()[-30:])]
        return gr.update(choices=choices, value=None)

    def show(self, rec_id: str | None) -> str:
        """One saved comparison's answers (record_html)."""
        if not rec_id:
            return ""
        try:
            return record_html(self.store.load(rec_id))
        except ResultsError as e:
            return f'<div class="dsbd-card-error">⚠️ {escape(str(e))}</div>'

    def export(self, fmt: str) -> tuple:
        records = self.store.list()
        if not records:
            return gr.update(visible=False), "Nothing to export yet."
        path = self.store.export(records, fmt)
        return gr.update(value=str(path), visible=True), f"Exported {len(records)} comparisons to {path.name}."

    def import_file(self, path) -> str:
        """Merge a JSON or CSV export (someone else's results, or a backup) into this store."""
        if not path:
            return "Pick a .json or .csv export."
        path = Path(path if isinstance(path, str) else path.name)
        try:
            n = self.store.import_records(read_export(path))
        except (ValueError, KeyError, TypeError, OSError) as e:
            return f"Not imported: {path.name} is not a comparisons export ({e})."
        return f"Imported {n} comparisons from {path.name}; press Refresh."

    def report(self) -> tuple:
        """Write the report (PNG + HTML per model pair): (image, files, status)."""
        from app.compare.report import write_report

        records = self.store.list()
        if not records:
            return gr.skip(), gr.update(visible=False), "No saved comparisons yet."
        paths = write_report(records, self.store.exports_dir)
        return (str(paths[0]), gr.update(value=[str(p) for p in paths], visible=True),
                f"Report for {len(paths) // 2} model pair(s): {', '.join(p.name for p in paths)}.")


# -- the tab's views: widgets first (create_*), then their events (wire_*) -----------------------------------
FAST = dict(concurrency_limit=None, show_progress="hidden")


def build(engine, session: gr.State, system: gr.Textbox, panel, store: ResultStore | None = None) -> CompareUI:
    """The Compare tab in three views (Blind compare, Prompt sets, Results & report); `panel` is the chat tab's
    decoding panel (shared settings)."""
    ui = CompareUI(engine, store or ResultStore())
    with gr.Tabs():
        with gr.Tab("Blind compare", id="compare-one"):
            w = create_blind_view()
        with gr.Tab("Prompt sets", id="compare-sets"):
            w |= create_sets_view()
        with gr.Tab("Results & report", id="compare-results") as results_tab:
            w |= create_results_view()
    w["results_tab"] = results_tab
    settings = [system, *panel.components]
    wire_blind_view(ui, w, session, settings)
    wire_sets_view(ui, w, settings)
    wire_results_view(ui, w)
    return ui


def create_blind_view() -> dict:
    """One prompt, the modes, Compare / Stop / Vote on the next pending, the cards, the vote and the plot."""
    gr.Markdown("One prompt, several modes, the same seed, answered one after another. Blind: the "
                "answers appear as they finish under labels A, B, … in a random order; your vote reveals "
                "the modes. Other settings come from the decoding panel on the Chat tab.")
    w = {}
    with gr.Row():
        w["prompt"] = gr.Textbox(label="Prompt", lines=3, scale=4, elem_id="compare-prompt")
        with gr.Column(scale=2):
            w["modes"] = gr.CheckboxGroup(list(MODES), value=DEFAULT_MODES, label="Modes", elem_id="compare-modes")
            w["blind"] = gr.Checkbox(value=True, label="Blind (hide the modes until I vote)", elem_id="compare-blind")
            with gr.Row():
                w["run"] = gr.Button("Compare", variant="primary", elem_id="compare-run")
                w["stop"] = gr.Button("Stop", variant="stop", elem_id="compare-stop")
                w["next"] = gr.Button("Vote on the next pending", elem_id="compare-next")
    w["status"] = gr.Markdown("", elem_id="compare-status")
    w["cards"] = gr.HTML(cards_html([]), elem_id="compare-cards")
    with gr.Row():
        w["vote"] = gr.Radio([], label="Which answer is better?", visible=False, elem_id="compare-vote", scale=4)
        w["vote_btn"] = gr.Button("Vote and reveal", visible=False, variant="primary", elem_id="compare-vote-btn")
    w["plot"] = gr.Plot(label="Speed vs quality", elem_id="compare-plot")
    return w


def create_sets_view() -> dict:
    """The prompt source (suite, pasted, uploaded), Start / Stop, unfinished runs to resume, the progress."""
    gr.Markdown("Run a list of prompts through the modes ticked on the Blind compare tab, in the background "
                "(chats still get answers between its generations). The code and files suites are graded by their "
                "hidden tests; chat prompts wait for your blind votes. Stop keeps what is done; Resume goes on.")
    w = {}
    with gr.Row():
        w["source"] = gr.Radio(list(SOURCES), value="chat suite", label="Prompts", elem_id="compare-set-source")
        w["limit"] = gr.Number(value=0, precision=0, label="Use the first N (0 = all)", elem_id="compare-set-limit")
    w["pasted"] = gr.Textbox(label="Pasted prompts (one per line)", lines=4, elem_id="compare-set-paste")
    w["upload"] = gr.File(label=UPLOAD_LABEL, file_types=[".jsonl", ".txt", ".json"], elem_id="compare-set-file")
    with gr.Row():
        w["start"] = gr.Button("Start", variant="primary", elem_id="compare-set-start")
        w["set_stop"] = gr.Button("Stop", variant="stop", elem_id="compare-set-stop")
        w["runs"] = gr.Dropdown([], label="Unfinished runs", elem_id="compare-set-runs", scale=3)
        w["resume"] = gr.Button("Resume", elem_id="compare-set-resume")
    w["set_bar"] = gr.HTML(_progress_html(0, 0, "idle"), elem_id="compare-set-progress")
    w["set_status"] = gr.Markdown("", elem_id="compare-set-status")
    w["timer"] = gr.Timer(1.0, active=False)
    return w


def create_results_view() -> dict:
    """Refresh, exports, import, the per-mode and per-pair tables, the report, and the saved comparisons (one
    shown with its answers)."""
    w = {}
    with gr.Row():
        w["refresh"] = gr.Button("Refresh", elem_id="compare-refresh")
        w["json"] = gr.Button("Export JSON", elem_id="compare-export-json")
        w["csv"] = gr.Button("Export CSV", elem_id="compare-export-csv")
        w["report"] = gr.Button("Quality report (PNG + HTML)", variant="primary", elem_id="compare-report")
    w["res_head"] = gr.Markdown("", elem_id="compare-results-head")
    w["res_status"] = gr.Markdown("", elem_id="compare-results-status")
    w["export_file"] = gr.File(label="Export", visible=False, interactive=False, elem_id="compare-export-file")
    w["import_file"] = gr.File(label="Import an export (.json / .csv)", file_types=[".json", ".csv"],
                               elem_id="compare-import-file")
    gr.Markdown("#### Per mode")
    w["mode_table"] = gr.HTML("", elem_id="compare-mode-table")
    gr.Markdown("#### Blind votes per pair of modes")
    w["pair_table"] = gr.HTML("", elem_id="compare-pair-table")
    w["report_img"] = gr.Image(label="Quality report", type="filepath", elem_id="compare-report-img")
    w["report_files"] = gr.File(label="Report files", file_count="multiple", visible=False, interactive=False,
                                elem_id="compare-report-files")
    gr.Markdown("#### Latest comparisons")
    w["listing"] = gr.HTML("", elem_id="compare-list")
    w["shown"] = gr.Dropdown([], label="Show a comparison's answers (with the diffs of files they rewrite)",
                             elem_id="compare-show")
    w["shown_cards"] = gr.HTML("", elem_id="compare-show-cards")
    return w


def wire_blind_view(ui: CompareUI, w: dict, session: gr.State, settings: list) -> None:
    inputs = [session, w["prompt"], w["modes"], w["blind"], *settings]
    outs = [w[k] for k in ("cards", "plot", "status", "vote", "vote_btn")]
    engine_ev = dict(concurrency_id=ENGINE_QUEUE, concurrency_limit=1, show_progress_on=[w["cards"]])
    w["run"].click(ui.run, inputs, outs, **engine_ev)
    w["prompt"].submit(ui.run, inputs, outs, **engine_ev)  # Enter in the prompt box runs it too
    w["stop"].click(lambda s: s.cancel.set() or "Stopping…", [session], [w["status"]], **FAST)
    w["vote_btn"].click(ui.vote, [session, w["vote"]], outs, **FAST)
    w["next"].click(ui.next_pending, [session], outs, **FAST)


def wire_sets_view(ui: CompareUI, w: dict, settings: list) -> None:
    """Start takes the modes ticked on the Blind compare view; the timer redraws the progress while a run goes."""
    progress = [w["set_bar"], w["set_status"], w["timer"]]
    w["start"].click(ui.set_start, [w[k] for k in ("source", "pasted", "upload", "limit", "modes")] + settings,
                     progress, **FAST)
    w["set_stop"].click(ui.set_stop, None, [w["set_status"]], **FAST)
    w["resume"].click(ui.set_resume, [w["runs"]], progress, **FAST)
    w["timer"].tick(ui.set_tick, None, progress + [w["runs"]], **FAST)


def wire_results_view(ui: CompareUI, w: dict) -> None:
    view = [w[k] for k in ("res_head", "mode_table", "pair_table", "listing", "runs")]
    for ev in (w["refresh"].click, w["results_tab"].select):
        ev(ui.results_view, None, view, **FAST).then(ui.saved_choices, None, [w["shown"]], **FAST)
    w["shown"].change(ui.show, [w["shown"]], [w["shown_cards"]], **FAST)
    w["json"].click(lambda: ui.export("json"), None, [w["export_file"], w["res_status"]], **FAST)
    w["csv"].click(lambda: ui.export("csv"), None, [w["export_file"], w["res_status"]], **FAST)
    w["report"].click(ui.report, None, [w["report_img"], w["report_files"], w["res_status"]], **FAST)
    w["import_file"].upload(ui.import_file, [w["import_file"]], [w["res_status"]], **FAST)
