"""The Models tab's Hugging Face views, over backends.modelfiles.hub: Discover (search GGUF repos, a repo's files by
quantization with fit badges, Download) and Downloads (the queue: bytes, speed, ETA; pause, resume, cancel with
confirmation).

Downloads resume after a stop or an app restart (the hub module's partial files come back as paused jobs). A
finished download appears in the library and in the target and draft lists. `HubUI` holds the handlers (plain
values, tested without a server); `create(models_ui)` makes both views' widgets and `HubUI.wire(...)` connects
them to the load form's target, context and draft.
"""

from __future__ import annotations

import threading
from html import escape
from pathlib import Path

import gradio as gr

from app.config import ConfigError
from backends.base import BackendError
from backends.modelfiles.presets import PRESETS

SEARCH_HEADERS = ["repo", "params", "downloads", "likes", "updated", "as a draft"]
FILE_HEADERS = ["quantization", "file", "size", "shards", "fits", "plan"]
_ACTIVE = ("queued", "running")
FILE_TYPES = ["str", "str", "str", "str", "html", "str"]
FAST = dict(concurrency_limit=None, show_progress="hidden")  # quick handlers: no queue slot, no spinner
NET = dict(concurrency_id="hub", concurrency_limit=2, show_progress="minimal")  # Hub requests: two at a time
VIEW_DISCOVER, VIEW_DOWNLOADS = "discover", "downloads"  # the Models tab's views (sub-tabs) made here


def on_disk(source: str, role: str) -> bool:
    """Whether `source` names a file already on this machine, so planning it reads a header and never fetches,
    assembles or hashes anything (a preset counts once assembled and verified)."""
    source = (source or "").strip()
    if not source:
        return False
    if source in PRESETS:
        from backends.modelfiles.presets import list_models

        return any(r["preset"] == source and role in r["role"].split("+") and r["status"] == "verified"
                   for r in list_models())
    if Path(source).expanduser().exists():
        return True
    repo, sep, filename = source.partition(":")
    if sep and filename.endswith(".gguf"):
        from backends.modelfiles.presets import downloaded_file

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
    from backends.modelfiles.library import format_bytes

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
        self._listings: dict[str, object] = {}  # repo -> backends.modelfiles.hub.RepoFiles, as last listed

    @property
    def manager(self):
        """The download queue, made on first use (it brings back downloads an earlier run left paused)."""
        from backends.modelfiles import hub

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
        from backends.modelfiles import hub

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
        from backends.modelfiles.library import format_params

        return [m.id, format_params(m.params) or "", m.downloads if m.downloads is not None else "",
                m.likes if m.likes is not None else "", (m.last_modified or "")[:10], note]

    def family(self, target: str) -> tuple[list[list], str]:
        """Drafts of the target's family on the Hub, each checked against the target from its fetched header."""
        from backends.modelfiles import hub, library

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
        from backends.modelfiles import hub, library

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

        from backends.modelfiles import hub

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
        from backends.modelfiles import hub

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
        return queue_html(self.jobs()), f"Queued {name} ({_size(group.size)}); Downloads shows its progress."

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
        """The widgets queue_view() fills, the Downloads view's status line among them."""
        w = self.widgets
        return [w["queue"], w["job"], w["queue_status"], w["timer"]]

    def wire(self, *, family, target, n_ctx, draft, views, library) -> None:
        """Connect the widgets made by create() to the load form (its family button, target, context and draft),
        the Models tab's views (`views`: the family button opens Discover) and the library (`library`: its
        refresh handler, inputs and outputs, run when a download finishes)."""
        self.wire_discover(family=family, target=target, n_ctx=n_ctx, draft=draft, views=views)
        self.wire_downloads(library)

    def wire_discover(self, *, family, target, n_ctx, draft, views) -> None:
        """Search, Drafts of the same family, a repo's files, Download."""
        w = self.widgets
        found = [w["results"], w["status"]]
        w["search"].click(self.search, [w["query"], w["sort"]], found, **NET)
        w["query"].submit(self.search, [w["query"], w["sort"]], found, **NET)
        family.click(lambda: gr.update(selected=VIEW_DISCOVER), None, views, **FAST).then(
            self.family, target, found, **NET)

        def pick_repo(evt: gr.SelectData, ctx, d):
            repo = (evt.row_value or [""])[0]
            return (repo, *self.files(repo, ctx, d))
        w["results"].select(pick_repo, [n_ctx, draft], [w["repo"], w["files"], w["status"]], **NET)
        w["list"].click(self.files, [w["repo"], n_ctx, draft], [w["files"], w["status"]], **NET)

        def pick_file(evt: gr.SelectData):
            return (evt.row_value or ["", ""])[1]
        w["files"].select(pick_file, None, w["file"], **FAST)

        def start(repo, name):
            html, status = self.download(repo, name)
            return self.queue_view(status, pick=f"{(repo or '').strip()}:{(name or '').strip()}")
        w["download"].click(start, [w["repo"], w["file"]], [w["queue"], w["job"], w["status"], w["timer"]], **FAST)

    def wire_downloads(self, library) -> None:
        """The queue's timer (a finished download refreshes the library), Pause, Resume, Cancel with
        confirmation, Refresh."""
        w, queue_view, queue_out = self.widgets, self.queue_view, self.queue_outputs
        lib_fn, lib_in, lib_out = library

        def tick(seen, *lib_args):
            done = self.done_count()
            html, jobs, _, timer = queue_view()
            if done > seen:  # a download finished: the library and the target list know it now
                return (html, jobs, timer, done, *lib_fn(*lib_args))
            return (html, jobs, timer, seen, *(gr.skip() for _ in lib_out))
        w["timer"].tick(tick, [w["seen"], *lib_in], [w["queue"], w["job"], w["timer"], w["seen"], *lib_out], **FAST)
        w["pause"].click(lambda j: queue_view(self.pause(j)), w["job"], queue_out, **FAST)
        w["resume"].click(lambda j: queue_view(self.resume(j)), w["job"], queue_out, **FAST)

        def ask_cancel(j):
            text, ok = self.cancel_plan(j)
            return gr.update(visible=ok), text if ok else "", gr.skip() if ok else text
        w["cancel"].click(ask_cancel, w["job"], [w["confirm"], w["confirm_text"], w["queue_status"]], **FAST)
        w["cancel_no"].click(lambda: (gr.update(visible=False), "The download stays."), None,
                             [w["confirm"], w["queue_status"]], **FAST)

        def do_cancel(j):
            said = self.cancel(j)
            return (gr.update(visible=False), *queue_view(said))
        w["cancel_yes"].click(do_cancel, w["job"], [w["confirm"], *queue_out], **FAST)
        w["refresh"].click(lambda: queue_view(), None, queue_out, **FAST)


def create(models_ui) -> HubUI:
    """The Discover and Downloads views (sub-tabs of the Models tab's gr.Tabs); HubUI.wire() connects them."""
    ui = HubUI(models_ui)
    with gr.Tab("Discover", id=VIEW_DISCOVER, elem_id="models-view-discover"):
        ui.widgets = create_discover()
    with gr.Tab("Downloads", id=VIEW_DOWNLOADS, elem_id="models-view-downloads"):
        ui.widgets |= create_downloads(ui)
    return ui


def create_discover() -> dict:
    """Discover: the search and its results, then the picked repo (List files), the picked file (Download) and
    the repo's files."""
    from backends.modelfiles import hub

    w = {}
    with gr.Row():
        w["query"] = gr.Textbox(label="Search Hugging Face (GGUF repos)",
                                placeholder="e.g. qwen2.5 coder, llama 3.2 1b, smollm2", scale=4, elem_id="hub-query")
        w["sort"] = gr.Dropdown(list(hub.SORTS), value="downloads", label="Sort by", scale=1, elem_id="hub-sort")
        w["search"] = gr.Button("Search", size="sm", elem_id="hub-search", scale=0, min_width=100)
    w["status"] = gr.Markdown("", elem_id="hub-status")
    w["results"] = gr.Dataframe(headers=SEARCH_HEADERS, interactive=False, elem_id="hub-results", wrap=True,
                                max_height=200)
    with gr.Row():
        w["repo"] = gr.Textbox(label="Repo", placeholder="org/name", scale=3, elem_id="hub-repo")
        w["list"] = gr.Button("List files", size="sm", elem_id="hub-list", scale=1)
        w["file"] = gr.Textbox(label="File (click one below)", scale=3, elem_id="hub-file")
        w["download"] = gr.Button("Download", variant="primary", size="sm", elem_id="hub-download", scale=1)
    w["files"] = gr.Dataframe(headers=FILE_HEADERS, datatype=FILE_TYPES, interactive=False, elem_id="hub-files",
                              wrap=True, max_height=200)
    return w


def create_downloads(ui: HubUI) -> dict:
    """Downloads: the queue, then the picked download's Pause, Resume and Cancel (with its confirmation)."""
    from backends.modelfiles import hub

    if hub.partial_downloads():  # an earlier run's partial files come back as paused downloads
        ui.manager
    w = {"queue": gr.HTML(queue_html(ui.jobs()), elem_id="hub-queue")}
    with gr.Row():
        w["job"] = gr.Dropdown(ui.job_ids(), label="Download", scale=3, elem_id="hub-job")
        w["pause"] = gr.Button("Pause", size="sm", elem_id="hub-pause")
        w["resume"] = gr.Button("Resume", size="sm", elem_id="hub-resume")
        w["cancel"] = gr.Button("Cancel…", size="sm", variant="stop", elem_id="hub-cancel")
        w["refresh"] = gr.Button("Refresh", size="sm", elem_id="hub-refresh")
    with gr.Row(visible=False) as w["confirm"]:
        w["confirm_text"] = gr.Markdown(elem_id="hub-cancel-text")
        w["cancel_yes"] = gr.Button("Yes, cancel and delete", variant="stop", size="sm", elem_id="hub-cancel-yes")
        w["cancel_no"] = gr.Button("Keep downloading", size="sm", elem_id="hub-cancel-no")
    w["queue_status"] = gr.Markdown("", elem_id="hub-queue-status")
    w["timer"] = gr.Timer(1.0, active=False)
    w["seen"] = gr.State(ui.done_count())
    return w
