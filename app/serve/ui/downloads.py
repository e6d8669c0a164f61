"""The Models tab's Hugging Face part: search (GGUF repos), a repo's files by quantization with fit badges, and
the download queue (bytes, speed, ETA; pause, resume, cancel with confirmation), over backends.hub.

Downloads resume after a stop or an app restart (the hub module's partial files come back as paused jobs). A
finished download appears in the library and in the target and draft lists. `HubUI` holds the handlers (plain
values, tested without a server); `build(models_ui)` makes the widgets and `wire(...)` connects them to the
load form's target, context and draft.
"""

from __future__ import annotations

import threading
from html import escape
from pathlib import Path

import gradio as gr

from app.config import ConfigError
from backends.base import BackendError
from backends.presets import PRESETS

SEARCH_HEADERS = ["repo", "params", "downloads", "likes", "updated", "as a draft"]
FILE_HEADERS = ["quantization", "file", "size", "shards", "fits", "plan"]
_ACTIVE = ("queued", "running")
FILE_TYPES = ["str", "str", "str", "str", "html", "str"]


def on_disk(source: str, role: str) -> bool:
    """Whether `source` names a file already on this machine, so planning it reads a header and never fetches,
    assembles or hashes anything (a preset counts once assembled and verified)."""
    source = (source or "").strip()
    if not source:
        return False
    if source in PRESETS:
        from backends.presets import list_models

        return any(r["preset"] == source and role in r["role"].split("+") and r["status"] == "verified"
                   for r in list_models())
    if Path(source).expanduser().exists():
        return True
    repo, sep, filename = source.partition(":")
    if sep and filename.endswith(".gguf"):
        from backends.presets import downloaded_file

        return downloaded_file(repo, filename).is_file()
    return False


def fit_html(fit) -> str:
    """A planning.Fit as a coloured badge (style.css: green in VRAM, amber offloaded, blue CPU, red no)."""
    return (f'<span class="dsbd-fit dsbd-fit-{escape(fit.badge)}" title="{escape(fit.detail)}">'
            f"{escape(fit.label)}</span>")


def form_int(value, name: str, *, low: int) -> int | None:
    """A form number as an int (None when empty); ConfigError for a fraction or a value below `low`."""
    if value is None or value == "":
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a whole number, got {value!r}") from None
    if f != int(f) or f < low:
        raise ConfigError(f"{name} must be a whole number >= {low}, got {value}")
    return int(f)


def _size(n: int | float) -> str:
    from backends.library import format_bytes

    return format_bytes(n)


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def queue_html(jobs) -> str:
    """The download queue as a table: state, file, a bar, bytes, speed, ETA, and an error if any."""
    if not jobs:
        return '<div id="hub-queue-empty">No downloads yet.</div>'
    rows = []
    for p in jobs:
        total = _size(p.total) if p.total else "?"
        speed = f"{_size(p.speed)}/s" if p.state == "running" and p.speed else ""
        eta = _eta(p.eta) if p.state == "running" else ""
        err = f'<div class="dsbd-card-error">{escape(p.error)}</div>' if p.error else ""
        rows.append(f'<tr data-job="{escape(p.id)}" data-state="{p.state}"><td class="dsbd-dl-{p.state}">'
                    f"{p.state}</td><td><code>{escape(p.filename)}</code><br><small>{escape(p.repo)}</small>{err}</td>"
                    f'<td><progress value="{p.fraction:.3f}" max="1"></progress> {p.fraction:.0%}</td>'
                    f"<td>{_size(p.done)} / {total}</td><td>{speed}</td><td>{eta}</td></tr>")
    return ('<table class="dsbd-results" id="hub-queue-table"><tr><th>state</th><th>file</th><th>progress</th>'
            "<th>bytes</th><th>speed</th><th>ETA</th></tr>" + "".join(rows) + "</table>")


class HubUI:
    """Handlers of the Hugging Face part of the Models tab; one download queue for the whole app."""

    def __init__(self, models_ui) -> None:
        self.models = models_ui
        self._manager = None
        self._lock = threading.Lock()
        self._listings: dict[str, object] = {}  # repo -> backends.hub.RepoFiles, as last listed

    @property
    def manager(self):
        """The download queue, made on first use (it brings back downloads an earlier run left paused)."""
        from backends import hub

        with self._lock:
            if self._manager is None:
                self._manager = hub.DownloadManager()
            return self._manager

    def close(self) -> None:
        with self._lock:
            if self._manager is not None:
                self._manager.close()

    # -- search
    def search(self, query: str, sort: str = "downloads") -> tuple[list[list], str]:
        """(result rows, status) for a search of GGUF repos."""
        from backends import hub

        try:
            found = hub.search(query or "", sort=sort or "downloads")
        except BackendError as e:
            return [], f"⚠️ {e}"
        if not found:
            return [], f"No GGUF repo matches {query!r}."
        return [self._row(m) for m in found], \
            f"{len(found)} GGUF repo(s) on {hub.endpoint()}. Click one for its files."

    @staticmethod
    def _row(m, note: str = "") -> list:
        from backends.library import format_params

        return [m.id, format_params(m.params) or "", m.downloads if m.downloads is not None else "",
                m.likes if m.likes is not None else "", (m.last_modified or "")[:10], note]

    def family(self, target: str) -> tuple[list[list], str]:
        """Drafts of the target's family on the Hub, each checked against the target from its fetched header."""
        from backends import hub, library

        target = (target or "").strip()
        try:
            entries = library.scan().entries
            entry = library.match_source(target, "target", entries) if target else None
        except BackendError as e:
            return [], f"⚠️ {e}"
        if entry is None or not entry.family:
            return [], ("Pick a target that is on this machine first: its header names its model family "
                        "(general.basename), which the search uses.")
        try:
            found = hub.family_drafts(entry.family, below_params=entry.params, limit=6)
        except BackendError as e:
            return [], f"⚠️ {e}"
        rows = [self._row(m, self._check(m.id, entry)) for m in found]
        if not rows:
            return [], f"No smaller GGUF repo of the {entry.family} family on the Hub."
        return rows, (f"{len(rows)} smaller repo(s) of the {entry.family} family; 'as a draft' is checked on the "
                      "smallest file's header. Click one for its files.")

    def _check(self, repo: str, target) -> str:
        """Whether the smallest model file of `repo` can draft for the local `target`, from its header only."""
        from backends import hub, library

        try:
            listing = self._listings[repo] = hub.repo_files(repo)
            groups = [g for g in listing.groups if g.kind == "model"]
            if not groups:
                return "no GGUF model file"
            head = hub.fetch_header(repo, groups[0].files[0].path)
            c = library.check_pair(head, target.path, target_entry=target)
        except BackendError as e:
            return f"not checked: {e}"
        return "✓ compatible" if c.compatible else f"✗ {c.reasons[0]}"

    # -- a repo's files
    def files(self, repo: str, n_ctx=None, draft: str = "") -> tuple[list[list], str]:
        """(one row per downloadable model of `repo`: quantization, file, size, shards, fit badge, plan; status)."""
        from app.engine.planning import hub_fits

        from backends import hub

        repo = (repo or "").strip()
        if not repo:
            return [], "Pick a repo from the search results first."
        try:
            listing = self._listings[repo] = hub.repo_files(repo)
        except BackendError as e:
            return [], f"⚠️ {e}"
        d = (draft or "").strip()
        try:
            ctx = form_int(n_ctx, "context length", low=16) or 4096
            fits = hub_fits(listing, draft=d if on_disk(d, "draft") else None, context=ctx)
            why = f"Fit badges at context {ctx}" + (" with the chosen draft." if on_disk(d, "draft") else ".")
        except Exception as e:  # noqa: BLE001 - badges are advice; the files still list
            fits, why = {}, f"No fit badges ({e})."
        rows = []
        for g in listing.groups:
            fit = fits.get(g.name)
            shards = f"{g.shards}" + ("" if g.complete else " (incomplete on the Hub)")
            rows.append([g.quant, g.name, _size(g.size), shards, fit_html(fit) if fit else "",
                         fit.detail if fit else ("a vision projector, not a language model" if g.kind != "model"
                                                 else "")])
        if not rows:
            return [], f"{repo} has no .gguf file."
        return rows, f"{len(rows)} file(s) in {repo}. {why} Click a file, then Download."

    # -- downloads
    def download(self, repo: str, name: str) -> tuple[str, str]:
        """Queue every file of the chosen model (all shards of a split one): (queue html, status)."""
        from backends import hub

        repo, name = (repo or "").strip(), (name or "").strip()
        if not repo or not name:
            return queue_html(self.jobs()), "Pick a repo and one of its files first."
        try:
            listing = self._listings.get(repo) or hub.repo_files(repo)
            group = listing.group(name)
            if not group.complete:
                missing = f"⚠️ {name}: some of its {group.shards} shards are missing on the Hub."
                return queue_html(self.jobs()), missing
            for f in group.files:
                self.manager.add(repo, f.path, revision=listing.revision)
        except BackendError as e:
            return queue_html(self.jobs()), f"⚠️ {e}"
        return queue_html(self.jobs()), f"Queued {name} ({_size(group.size)})."

    def jobs(self) -> list:
        return self.manager.jobs() if self._manager is not None else []

    def job_ids(self) -> list[str]:
        return [p.id for p in self.jobs() if p.state not in ("done", "cancelled")]

    def active(self) -> bool:
        return any(p.state in _ACTIVE for p in self.jobs())

    def done_count(self) -> int:
        return sum(p.state == "done" for p in self.jobs())

    def pause(self, job_id: str) -> str:
        return self._act(job_id, "pause", "Paused {}: its partial file is kept and resumes.")

    def resume(self, job_id: str) -> str:
        return self._act(job_id, "resume", "Resuming {} from the bytes on disk.")

    def _act(self, job_id: str, verb: str, said: str) -> str:
        if not job_id:
            return "Pick a download first."
        try:
            p = getattr(self.manager, verb)(job_id)
        except BackendError as e:
            return f"⚠️ {e}"
        return said.format(p.filename)

    def cancel_plan(self, job_id: str) -> tuple[str, bool]:
        """(what cancelling would delete, whether to ask for confirmation)."""
        if not job_id:
            return "Pick a download first.", False
        try:
            plan = self.manager.cancel(job_id)
        except BackendError as e:
            return f"⚠️ {e}", False
        return f"**Cancel the download?** It {escape(plan.describe().split(': ', 1)[1])}.", True

    def cancel(self, job_id: str) -> str:
        try:
            plan = self.manager.cancel(job_id, confirm=True)
        except BackendError as e:
            return f"⚠️ {e}"
        return plan.describe()[0].upper() + plan.describe()[1:] + "."

    # -- widgets
    def queue_view(self, status=gr.skip(), pick: str | None = None) -> tuple:  # noqa: B008 (a skip, not a default)
        """(queue html, the download picker, status, the timer: ticking while a download is queued or running)."""
        ids = self.job_ids()
        picker = gr.update(choices=ids, value=pick) if pick in ids else gr.update(choices=ids)
        return queue_html(self.jobs()), picker, status, gr.Timer(active=self.active())

    @property
    def queue_outputs(self) -> list:
        w = self.widgets
        return [w["queue"], w["job"], w["status"], w["timer"]]

    def wire(self, *, family, target, n_ctx, draft, library) -> None:
        """Connect the widgets made by build() to the load form (set by models.build once both exist)."""
        w = self.widgets
        fast = dict(concurrency_limit=None, show_progress="hidden")
        net = dict(concurrency_id="hub", concurrency_limit=2, show_progress="minimal")
        lib_fn, lib_in, lib_out = library

        w["search"].click(self.search, [w["query"], w["sort"]], [w["results"], w["status"]], **net)
        w["query"].submit(self.search, [w["query"], w["sort"]], [w["results"], w["status"]], **net)
        family.click(self.family, target, [w["results"], w["status"]], **net)

        def pick_repo(evt: gr.SelectData, ctx, d):
            repo = (evt.row_value or [""])[0]
            return (repo, *self.files(repo, ctx, d))
        w["results"].select(pick_repo, [n_ctx, draft], [w["repo"], w["files"], w["status"]], **net)
        w["list"].click(self.files, [w["repo"], n_ctx, draft], [w["files"], w["status"]], **net)
        def pick_file(evt: gr.SelectData):
            return (evt.row_value or ["", ""])[1]
        w["files"].select(pick_file, None, w["file"], **fast)

        queue_view, queue_out = self.queue_view, self.queue_outputs

        def start(repo, name):
            html, status = self.download(repo, name)
            return queue_view(status, pick=f"{(repo or '').strip()}:{(name or '').strip()}")
        w["download"].click(start, [w["repo"], w["file"]], queue_out, **fast)

        def tick(seen, *lib_args):
            done = self.done_count()
            html, jobs, _, timer = queue_view()
            if done > seen:  # a download finished: the library and the target list know it now
                return (html, jobs, timer, done, *lib_fn(*lib_args))
            return (html, jobs, timer, seen, *(gr.skip() for _ in lib_out))
        w["timer"].tick(tick, [w["seen"], *lib_in], [w["queue"], w["job"], w["timer"], w["seen"], *lib_out], **fast)
        w["pause"].click(lambda j: queue_view(self.pause(j)), w["job"], queue_out, **fast)
        w["resume"].click(lambda j: queue_view(self.resume(j)), w["job"], queue_out, **fast)

        def ask_cancel(j):
            text, ok = self.cancel_plan(j)
            return gr.update(visible=ok), text if ok else "", gr.skip() if ok else text
        w["cancel"].click(ask_cancel, w["job"], [w["confirm"], w["confirm_text"], w["status"]], **fast)
        w["cancel_no"].click(lambda: (gr.update(visible=False), "The download stays."), None,
                             [w["confirm"], w["status"]], **fast)

        def do_cancel(j):
            said = self.cancel(j)
            return (gr.update(visible=False), *queue_view(said))
        w["cancel_yes"].click(do_cancel, w["job"], [w["confirm"], *queue_out], **fast)
        w["refresh"].click(lambda: queue_view(), None, queue_out, **fast)


def build(models_ui) -> HubUI:
    """The Hugging Face widgets (inside the Models tab); wire() connects them."""
    from backends import hub

    ui = HubUI(models_ui)
    gr.Markdown("### Hugging Face: find and download GGUF models")
    with gr.Row():
        query = gr.Textbox(label="Search", placeholder="e.g. qwen2.5 coder, llama 3.2 1b, smollm2", scale=4,
                           elem_id="hub-query")
        sort = gr.Dropdown(list(hub.SORTS), value="downloads", label="Sort by", scale=1, elem_id="hub-sort")
        search = gr.Button("Search", size="sm", elem_id="hub-search")
    status = gr.Markdown("", elem_id="hub-status")
    results = gr.Dataframe(headers=SEARCH_HEADERS, interactive=False, elem_id="hub-results", wrap=True)
    with gr.Row():
        repo = gr.Textbox(label="Repo", placeholder="org/name", scale=3, elem_id="hub-repo")
        list_btn = gr.Button("List files", size="sm", elem_id="hub-list")
    files = gr.Dataframe(headers=FILE_HEADERS, datatype=FILE_TYPES, interactive=False, elem_id="hub-files", wrap=True)
    with gr.Row():
        file = gr.Textbox(label="File", scale=3, elem_id="hub-file")
        download = gr.Button("Download", variant="primary", size="sm", elem_id="hub-download")
    gr.Markdown("#### Downloads")
    if hub.partial_downloads():  # an earlier run's partial files come back as paused downloads
        ui.manager
    queue = gr.HTML(queue_html(ui.jobs()), elem_id="hub-queue")
    with gr.Row():
        job = gr.Dropdown(ui.job_ids(), label="Download", scale=3, elem_id="hub-job")
        pause = gr.Button("Pause", size="sm", elem_id="hub-pause")
        resume = gr.Button("Resume", size="sm", elem_id="hub-resume")
        cancel = gr.Button("Cancel…", size="sm", variant="stop", elem_id="hub-cancel")
        refresh = gr.Button("Refresh", size="sm", elem_id="hub-refresh")
    with gr.Row(visible=False) as confirm:
        confirm_text = gr.Markdown(elem_id="hub-cancel-text")
        cancel_yes = gr.Button("Yes, cancel and delete", variant="stop", size="sm", elem_id="hub-cancel-yes")
        cancel_no = gr.Button("Keep downloading", size="sm", elem_id="hub-cancel-no")
    timer = gr.Timer(1.0, active=False)
    seen = gr.State(ui.done_count())
    ui.widgets = dict(query=query, sort=sort, search=search, status=status, results=results, repo=repo, list=list_btn,
                      files=files, file=file, download=download, queue=queue, job=job, pause=pause, resume=resume,
                      cancel=cancel, refresh=refresh, confirm=confirm, confirm_text=confirm_text,
                      cancel_yes=cancel_yes, cancel_no=cancel_no, timer=timer, seen=seen)
    return ui
