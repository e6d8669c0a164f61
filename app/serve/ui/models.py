"""Models tab, in four views (sub-tabs): Loaded & load (a load form: context, GPU layers, threads, backends, a
draft picker that says why a file is refused; the memory plan of what it would load, the load's progress by
stage, Cancel and Unload), Library (the models on this machine), and Discover and Downloads (Hugging Face
search and the download queue, app.serve.ui.downloads). Each view's widgets are made by a `create_*` function
and connected by a `wire_*` one.

Handlers are methods of `ModelsUI` returning plain values (one per output widget), so tests drive them without a
server. A load is a `LoadJob`: `engine.swap` on a background thread with a progress listener and a cancel
Event (backends.load_progress), so the page streams its stages and Cancel stops it; the new models load beside the
serving ones and replace them only once both loaded and their vocabularies match: a failure or a cancel keeps
the old ones serving.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from html import escape
from pathlib import Path
from typing import Iterator, NamedTuple

import gradio as gr

from app.config import MODE_FACTS, ConfigError
from app.engine.interface import NoModelLoaded
from app.serve.ui import downloads
from app.serve.ui.downloads import FAST, fit_html, form_int, on_disk
from app.serve.ui.settings import default_settings, params_from
from app.serve.ui.stats import memory_line
from backends.base import BackendError
from backends.load_progress import STAGES, LoadCancelled, LoadStep
from backends.modelfiles.presets import PRESETS
from backends.registry import BACKENDS, ModelSpec
from backends.tokenizer import VocabMismatch

log = logging.getLogger(__name__)
LOAD_QUEUE = "model-load"  # its own concurrency group: a load neither waits behind nor blocks the answers
SOURCE_HINT = ("pick a model from the library, or type a preset (tiny, qwen-coder), a .gguf path, a safetensors "
               "folder, or a Hugging Face id org/name:file.gguf")
_LABELS = {"target": "Target model", "target_backend": "Target backend", "target_source": "Target source",
           "draft": "Draft model", "draft_backend": "Draft backend", "draft_source": "Draft source",
           "n_ctx": "Context window (tokens)", "target_placement": "Target placement (RPC workers)",
           "draft_placement": "Draft placement"}
SWITCH_NOTE = ("The same settings as `--target` / `--draft`, `--target-backend` / `--draft-backend`, `--ctx`, "
               "`--n-gpu-layers` and `--threads` on the command line (dtype and device stay as loaded). The current "
               "models keep answering while the new ones load, and stay if the load fails or is cancelled.")
NO_MODEL = ("**No model is loaded.** Pick a target (and a draft) below and press Load; the chat and the API "
            "answer again once it is loaded.")
_MARKS = {"done": "✓", "now": "▸", "cancelled": "■", "failed": "✗"}  # stage marks (style.css colours them)
LIBRARY_HEADERS = ["id", "model", "arch", "params", "quant", "context", "size", "fits", "source", "location"]
LIBRARY_TYPES = ["str", "str", "str", "str", "str", "number", "str", "html", "str", "str"]
_STEP_EVERY_S = 0.25  # how often the page's progress is redrawn while a load runs
VIEW_LOAD, VIEW_LIBRARY = "load", "library"  # the views (sub-tabs) the page switches to


class ModelsView(NamedTuple):
    """What the loaded-models handlers return, in output-widget order."""

    status: str
    info: str
    plan: str
    memory: str


def _specs(engine) -> tuple[ModelSpec | None, ModelSpec | None]:
    return getattr(engine, "specs", None) or (None, None)  # engines built without specs (tests) have none


def describe_markdown(engine) -> str:
    """engine.describe() (plus where each model came from) as a table; a note when no draft is loaded."""
    try:
        info = engine.describe()
    except NoModelLoaded:
        return NO_MODEL
    except Exception as e:  # a half-loaded engine must still let the page open
        return f"⚠️ could not describe the engine: {e}"
    target, draft = _specs(engine)
    info |= {"target_source": tilde(target.source)} if target else {}
    info |= {"draft_source": tilde(draft.source)} if draft and "draft" in info else {}
    rows = "\n".join(f"| {_LABELS.get(k, k)} | `{v}` |" for k, v in info.items())
    md = "| | loaded |\n|---|---|\n" + rows
    if "draft" not in info:
        md += f"\n\nNo draft model: {modes(needs_draft=True)} need one (pick one below, or `--draft`)."
    return md


def plan_markdown(engine) -> str:
    """The memory plan of the loaded specs at the default decoding settings, or why not."""
    target, draft = _specs(engine)
    if target is None:
        return "No memory plan: no models were loaded from model specs."
    from app.engine.planning import PlanError, plan_for  # lazy: reading free VRAM may import torch

    try:
        plan = plan_for(target, draft, params_from(default_settings()))
    except PlanError as e:
        return f"⚠️ {e}"
    except Exception as e:  # the plan is advice: a failure must not break the tab
        return f"No memory plan for these models: {e}"
    return f"```text\n{plan.format()}\n```"


def loaded_summary(info: dict) -> str:
    text = f"target {info['target']} ({info['target_backend']})"
    if "draft" in info:
        text += f" + draft {info['draft']} ({info['draft_backend']})"
    return text + f", context {info['n_ctx']}"


def modes(*, needs_draft: bool) -> str:
    """The decoding modes that need a draft model (or run without one), from config.MODE_FACTS."""
    return ", ".join(m for m, f in MODE_FACTS.items() if f.concrete and f.needs_draft == needs_draft)



def tilde(path: str) -> str:
    """A path as the page shows it: the home folder as ~."""
    home = str(Path.home())
    return "~" + path[len(home):] if home not in ("", "/") and path.startswith(home + "/") else path


def _short(source: str) -> str:
    """A source as the page names it: a path by its file name, anything else as typed."""
    return Path(source).name if "/" in source and Path(source).expanduser().exists() else source




# -- a load in the background ----------------------------------------------------------------------------------
class LoadJob:
    """One load: `engine.swap` on a thread with a progress listener and a cancel Event, then (with a draft) the
    timed passes adaptive forests and auto mode use (the warm-up). `stages` keeps, per (role, stage), its last
    report and when it began and last reported."""

    def __init__(self, engine, target: ModelSpec, draft: ModelSpec | None) -> None:
        self.engine, self.specs = engine, (target, draft)
        self.cancel = threading.Event()
        self.changed = threading.Condition()
        self.stages: dict[tuple[str | None, str], list] = {}  # (role, stage) -> [LoadStep, t_first, t_last]
        self.info: dict | None = None
        self.error: BaseException | None = None
        self.warm_error: str | None = None
        self.done = False
        self.t0 = time.monotonic()
        self.t_end: float | None = None
        self.cancel_at: float | None = None
        self.thread = threading.Thread(target=self._run, name="dsbd-models-load", daemon=True)
        self.thread.start()

    def hear(self, step: LoadStep) -> None:
        now = time.monotonic()
        with self.changed:
            seen = self.stages.get((step.role, step.stage))
            self.stages[(step.role, step.stage)] = [step, seen[1] if seen else now, now]
            self.changed.notify_all()

    def _run(self) -> None:
        try:
            self.info = self.engine.swap(*self.specs, progress=self.hear, cancel=self.cancel)
            if hasattr(self.engine, "prepare"):  # the first answer's contexts, made while the user types
                threading.Thread(target=self._prepare, name="dsbd-models-prepare", daemon=True).start()
            if self.specs[1] is not None and hasattr(self.engine, "costs"):
                # Adaptive forests and auto mode price passes: timed now (or read from the timing cache), not
                # during the first answer. The models already serve: this step cannot be cancelled.
                self.hear(LoadStep("time", None, 0.0))
                try:
                    self.engine.costs()
                except Exception as e:  # noqa: BLE001 - the first adaptive answer times them instead
                    self.warm_error = str(e)
                self.hear(LoadStep("time", None, 1.0))
        except BaseException as e:  # noqa: BLE001 - shown to the user by the handler
            self.error = e
        finally:
            with self.changed:
                self.done, self.t_end = True, time.monotonic()
                self.changed.notify_all()

    def _prepare(self) -> None:
        try:
            self.engine.prepare()
        except Exception as e:  # noqa: BLE001 - the first answer makes its contexts itself
            log.info("preparing the contexts after a load failed (%s); the first answer makes them", e)

    def wait(self, timeout: float) -> None:
        """Until the next report or the end (at most `timeout` s)."""
        with self.changed:
            if not self.done:
                self.changed.wait(timeout)

    def stop(self) -> str:
        """Ask the load to stop (the Cancel button); what the page says meanwhile."""
        if self.done:
            return "Nothing to cancel: the load has finished."
        if ("time" in {stage for _, stage in self.stages}) or self.info is not None:
            return ("The new models already serve; timing their passes cannot be stopped and ends by itself "
                    "(otherwise the first answer would time them).")
        if self.cancel_at is None:
            self.cancel_at = time.monotonic()
        self.cancel.set()
        return "Cancelling… (the models that were serving keep serving)"

    def html(self) -> str:
        """The stages so far: a bar each, with its share done and its seconds."""
        with self.changed:
            rows = list(self.stages.items())
            done = self.done
        now = time.monotonic()
        lines = []
        for (role, stage), (step, t_first, t_last) in rows:
            finished = step.fraction >= 1.0 or (done and self.error is None)
            state = "done" if finished else "now" if not done else \
                "cancelled" if isinstance(self.error, LoadCancelled) else "failed"
            took = (t_last if finished or done else now) - t_first
            what = f"{role + ': ' if role else ''}{STAGES.get(stage, stage)}"
            detail = f" <code>{escape(step.detail)}</code>" if step.detail and stage != "load" else \
                f" <code>{escape(Path(step.detail).name)}</code>" if step.detail else ""
            frac = 1.0 if finished else step.fraction
            lines.append(f'<div class="dsbd-stage dsbd-stage-{state}" data-stage="{stage}" data-role="{role or ""}">'
                         f'<b class="dsbd-mark">{_MARKS[state]}</b> '
                         f'{escape(what)}{detail} <progress value="{frac:.3f}" max="1"></progress> '
                         f"{frac:.0%} · {took:.1f} s</div>")
        head = f"Loading {escape(self.what())}… {now - self.t0:.1f} s" if not done else \
            f"{escape(self.what())}: {self.t_end - self.t0:.1f} s"
        return f'<div id="models-load-stages"><div class="dsbd-stage-head">{head}</div>{"".join(lines)}</div>'

    def what(self) -> str:
        t, d = self.specs
        return f"{_short(t.source)} ({t.backend})" + (f" + draft {_short(d.source)} ({d.backend})" if d else "")


# -- the tab's handlers ---------------------------------------------------------------------------------------
class ModelsUI:
    """Handlers of the Models tab over one engine (one load at a time, whichever page started it)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.job: LoadJob | None = None
        self._job_lock = threading.Lock()

    # -- what is loaded
    def view(self, status: str = "") -> ModelsView:
        return ModelsView(status, describe_markdown(self.engine), plan_markdown(self.engine), memory_line())

    def unload(self, role: str) -> ModelsView:
        """The Unload buttons: the draft only, or both models."""
        if self.job is not None and not self.job.done:
            return self.view("⚠️ A load is running: cancel it or wait for it before unloading.")
        try:
            self.engine.unload(role)
        except NoModelLoaded:
            return self.view("Nothing to unload: no model is loaded.")
        except Exception as e:
            if not isinstance(e, (BackendError, ConfigError)):
                log.exception("unloading failed")
            return self.view(f"⚠️ Could not unload: {e}")
        if role == "draft":
            return self.view(f"Unloaded the draft: the target answers alone ({modes(needs_draft=False)}).")
        return self.view("Unloaded the models; their memory is free. " + NO_MODEL)

    # -- the load form
    def specs_from(self, target: str, target_backend: str, draft: str, draft_backend: str, n_ctx=None,
                   gpu_auto: bool = True, gpu_layers=None, threads=None) -> tuple[ModelSpec, ModelSpec | None]:
        """Form values -> (target, draft or None) specs; what the form leaves empty stays as loaded."""
        old_t, old_d = _specs(self.engine)
        base = old_t or ModelSpec(source="", n_ctx=getattr(self.engine, "n_ctx", 0) or 4096)
        target, draft = (target or "").strip(), (draft or "").strip()
        if not target:
            raise ConfigError(f"choose a target model: {SOURCE_HINT}")
        common = {}
        if (ctx := form_int(n_ctx, "context length", low=16)) is not None:
            common["n_ctx"] = ctx
        if gpu_auto:
            common["n_gpu_layers"] = None  # from the memory plan
        elif (layers := form_int(gpu_layers, "GPU layers", low=-1)) is not None:
            common["n_gpu_layers"] = layers
        else:
            raise ConfigError("GPU layers: enter a number (-1 = all, 0 = none) or tick 'from the memory plan'")
        common["n_threads"] = form_int(threads, "threads", low=0) or None  # 0 / empty: auto (backends.llamacpp ThreadGovernor)
        t = replace(base, source=target, backend=target_backend or base.backend, **common).validated()
        if not draft:
            return t, None
        d_base = old_d or base  # the CLI gives both roles the same threads / device / context / GPU layers
        # RPC workers (set by --rpc, never from this form) hold the target only: the draft stays local.
        return t, replace(d_base, source=draft, backend=draft_backend or d_base.backend, rpc=(), **common).validated()

    def form_plan(self, *form) -> str:
        """The memory plan this load would use (engine.memory_plan), redrawn as the form changes."""
        try:
            target, draft = self.specs_from(*form)
        except (ConfigError, BackendError) as e:
            return f"⚠️ {e}"
        missing = [f"{role} `{s.source}`" for role, s in (("target", target), ("draft", draft))
                   if s is not None and not on_disk(s.source, role)]
        if missing:
            return (f"The plan appears once {' and '.join(missing)} "
                    f"{'is' if len(missing) == 1 else 'are'} on this machine (downloaded below, or assembled "
                    "from the preset's packages when you press Load).")
        from app.engine.engine import memory_plan
        from app.engine.planning import PlanError

        try:
            plan = memory_plan(target, draft)
        except PlanError as e:
            return f"⚠️ This will not fit: {e}"
        except Exception as e:  # the plan is advice: a failure must not break the tab
            return f"No memory plan for these files: {e}"
        if plan is None:
            return "No memory plan for these files (the planner cannot size them); they still load."
        text = f"```text\n{plan.format()}\n```"
        if target.n_gpu_layers is not None and plan.target.n_gpu_layers is not None:
            text += (f"\nGPU layers set by hand: {target.n_gpu_layers} (the plan would put "
                     f"{plan.target.n_gpu_layers} on the GPU).")
        return text

    def load(self, *form) -> Iterator[tuple]:
        """The Load button: start a LoadJob, then redraw its stages until it ends: (progress, status, info,
        plan, memory)."""
        try:
            target, draft = self.specs_from(*form)
        except (ConfigError, BackendError) as e:
            yield "", f"⚠️ {e}", gr.skip(), gr.skip(), gr.skip()
            return
        with self._job_lock:
            if self.job is not None and not self.job.done:
                yield gr.skip(), (f"⚠️ Already loading {self.job.what()}: wait for it or press Cancel."), \
                    gr.skip(), gr.skip(), gr.skip()
                return
            job = self.job = LoadJob(self.engine, target, draft)
        while not job.done:
            yield job.html(), "Loading… (Cancel stops it; the current models keep answering meanwhile)", \
                gr.skip(), gr.skip(), gr.skip()
            job.wait(_STEP_EVERY_S)
        view = self.view(self.outcome(job))
        yield job.html(), view.status, view.info, view.plan, view.memory

    def outcome(self, job: LoadJob) -> str:
        """What the status line says once `job` ended."""
        e = job.error
        if e is None:
            warm = f" Timing the passes failed ({job.warm_error}); the first answer times them." \
                if job.warm_error else ""
            return f"✓ Loaded {loaded_summary(job.info)} in {job.t_end - job.t0:.1f} s.{warm}"
        still = "Still serving the previous models." if self._serving() else "No model is loaded."
        if isinstance(e, LoadCancelled):
            took = f" (stopped {job.t_end - job.cancel_at:.2f} s after Cancel)" if job.cancel_at else ""
            return f"■ Load cancelled{took}: {e}.\n\n{still}"
        if not isinstance(e, (BackendError, ConfigError)):
            log.error("loading models failed", exc_info=e)
        hint = " Pick a draft of the target's model family (the draft list shows which fit)." \
            if isinstance(e, VocabMismatch) else ""
        why = str(e).rstrip(".") or type(e).__name__
        return f"⚠️ Could not load: {why}.{hint}\n\n{still}"

    def cancel_load(self) -> str:
        """The Cancel button."""
        job = self.job
        if job is None or job.done:
            return "Nothing to cancel: no load is running."
        return job.stop()

    def _serving(self) -> bool:
        try:
            self.engine.describe()
        except Exception:  # NoModelLoaded, or a broken model process
            return False
        return True

    # -- the library
    def library(self, n_ctx=None, draft: str = "") -> tuple[list[list], str, list]:
        """(table rows, summary, target choices): every model file found, with a fit badge at the form's
        context with the form's draft (or the loaded one)."""
        from backends.modelfiles import library

        try:
            scan = library.scan()
        except Exception as e:  # noqa: BLE001 - a broken folder must not break the tab
            return [], f"⚠️ Could not list the models: {e}", self.target_choices([])
        fits = self._fits(scan.entries, n_ctx, draft)
        rows = []
        for e in scan.entries:
            fit = fits.get(e.path)
            fits_text = fit_html(fit) if fit is not None else (escape(e.problem or "not a language model")
                                                                if not e.usable else "")
            rows.append([e.id, e.name, e.arch or "", e.params_label or "", e.quant or "", e.context_length or "",
                         library.format_bytes(e.size), fits_text, e.source, tilde(e.path)])
        looked = ", ".join(tilde(f.path) for f in scan.folders if f.exists)
        summary = (f"{len(scan.entries)} model file(s) in {looked or 'no folder yet'} "
                   f"({scan.read} header(s) read, {scan.cached} from the cache, {scan.seconds:.2f} s). "
                   "Click a row for its card.")
        return rows, summary, self.target_choices(scan.entries)

    def _fits(self, entries, n_ctx, draft: str) -> dict:
        from app.engine.planning import library_fits

        d = (draft or "").strip()
        if not d or not on_disk(d, "draft"):
            loaded = _specs(self.engine)[1]
            d = loaded if loaded is not None and on_disk(loaded.source, "draft") else None
        try:
            ctx = form_int(n_ctx, "context length", low=16) or getattr(self.engine, "n_ctx", 0) or 4096
            return library_fits(entries, draft=d, context=ctx)
        except Exception as e:  # noqa: BLE001 - badges are advice
            log.warning("no fit badges: %s", e)
            return {}

    @staticmethod
    def target_choices(entries) -> list[tuple[str, str]]:
        """The target dropdown: every usable library file (its path), then the presets by name."""
        from backends.modelfiles.library import format_bytes

        out = [(f"{e.name} · {e.quant or '?'} · {format_bytes(e.size)}", e.path) for e in entries if e.usable]
        return out + [(f"preset {p}", p) for p in PRESETS]

    def card(self, entry_id: str) -> tuple[str, str]:
        """(card markdown, the selected file's path) for a library row."""
        from backends.modelfiles import library

        try:
            c = library.card(entry_id)
        except BackendError as e:
            return f"⚠️ {e}", ""
        e = c.entry
        facts = [("file", tilde(e.path) if len(e.files) == 1 else f"{tilde(e.path)} (+{len(e.files) - 1} shards)"),
                 ("architecture", e.arch), ("parameters", e.params_label), ("quantization", e.quant),
                 ("context length", e.context_length), ("layers", e.n_layers), ("size", library.format_bytes(e.size)),
                 ("complete", "yes" if e.complete else f"no: {e.problem}"), ("family", e.family),
                 ("chat template", "yes" if c.chat_template else "no (the chat falls back to a plain format)"),
                 ("tensors", c.tensors), ("found in", f"{tilde(e.folder)} ({e.source})")]
        md = f"#### {escape(e.name)}\n\n| | |\n|---|---|\n" + "\n".join(
            f"| {k} | `{v}` |" for k, v in facts if v not in (None, ""))
        keys = "\n".join(f"{k}: {v}" for k, v in c.metadata.items())
        md += f"\n\n<details><summary>All {len(c.metadata)} header keys</summary>\n\n```text\n{keys}\n```\n</details>"
        return md, e.path

    def delete_plan(self, path: str) -> tuple[str, bool]:
        """The Delete button: (what a delete would remove and free, whether to show the confirmation)."""
        from backends.modelfiles import library

        if not path:
            return "Click a model in the library first.", False
        try:
            plan = library.plan_delete(path)
        except BackendError as e:
            return f"⚠️ {e}", False
        if plan.refused:
            return f"⚠️ Cannot delete {plan.entry.name}: {plan.refused}", False
        for spec, role in zip(_specs(self.engine), ("target", "draft")):
            if spec is not None and library.match_source(spec.source, role, [plan.entry]) is not None:
                return f"⚠️ {plan.entry.name} is loaded as the {role}: unload it (or load another model) first.", \
                    False
        return f"**Delete?** {escape(plan.describe())}. This cannot be undone.", True

    def delete(self, path: str, n_ctx=None, draft: str = "") -> tuple[str, list[list], str, list]:
        """Yes, delete: (status, table rows, summary, target choices)."""
        from backends.modelfiles import library

        try:
            freed = library.delete(library.plan_delete(path))
        except BackendError as e:
            rows, summary, choices = self.library(n_ctx, draft)
            return f"⚠️ {e}", rows, summary, choices
        rows, summary, choices = self.library(n_ctx, draft)
        return f"Deleted: freed {library.format_bytes(freed)}.", rows, summary, choices

    def add_folder(self, folder: str, n_ctx=None, draft: str = "") -> tuple[str, list[list], str, list]:
        """Remember a folder of models (scanned in place, nothing copied): (status, rows, summary, choices)."""
        from backends.modelfiles import library

        try:
            kept = library.add_folder((folder or "").strip())
        except BackendError as e:
            return (f"⚠️ {e}", *self.library(n_ctx, draft))
        return (f"Added. Folders of yours: {', '.join(str(p) for p in kept)}", *self.library(n_ctx, draft))

    # -- the draft picker
    def drafts(self, target: str, current: str = "") -> tuple[list[tuple[str, str]], str, str]:
        """(draft choices: none, then the compatible local files, best size first; the draft to keep: `current`
        unless it is a library file this target refuses; notes: why each other file is refused, and what the
        app does without a draft)."""
        from backends.modelfiles import library

        none = [("none (the target alone)", "")]
        target, current = (target or "").strip(), (current or "").strip()
        if not target:
            return none, current, ""
        try:
            entries = library.scan().entries
            entry = library.match_source(target, "target", entries)
            if entry is None and not on_disk(target, "target"):
                return none, current, (f"The draft list appears once `{escape(target)}` is on this machine "
                                       "(download it below, or load it once).")
            advice = library.suggest_drafts(entry if entry is not None else target, entries)
        except Exception as e:  # noqa: BLE001 - the picker is advice: typing a draft still works
            return none, current, f"⚠️ Could not check drafts: {e}"
        good = [(f"✓ {c.entry.name} · {c.entry.quant or '?'} · {library.format_bytes(c.entry.size)} · {c.note}",
                 c.entry.path) for c in advice.candidates if c.compatible]
        refused = [c for c in advice.candidates if not c.compatible]
        smaller = [c for c in advice.candidates if c.compatible and c.ratio is not None and c.ratio < 1]
        notes = [f"{len(good)} compatible file(s) on this machine, best size first." if good else
                 "No file on this machine can draft for this target."]
        if not smaller:
            notes.append(f"None of them is smaller than the target, so none speeds it up. Without a draft the "
                         f"target runs {modes(needs_draft=False)}; {modes(needs_draft=True)} need a draft. Drafts "
                         "of the same family on Hugging Face: the button below.")
        chosen = library.match_source(current, "draft", entries) if current else None
        if chosen is not None:
            if chosen.path in {path for _, path in good}:
                current = chosen.path  # shown by its label
            else:
                why = next((c.reasons for c in refused if c.entry.path == chosen.path), ())
                notes.append(f"The draft `{escape(chosen.name)}` was cleared: it cannot draft for this target"
                             + (f" ({escape(why[0])})." if why else "."))
                current = ""
        if refused:
            notes.append("Refused:\n" + "\n".join(
                f"- **{escape(c.entry.name)}**: {escape('; '.join(c.reasons[:2]))}"
                + (f" (+{len(c.reasons) - 2} more)" if len(c.reasons) > 2 else "") for c in refused))
        return none + good, current, "\n\n".join(notes)


def _form_values(target: ModelSpec, draft: ModelSpec | None, n_ctx) -> tuple:
    """The load form's values for the loaded specs (the form opens on what is loaded)."""
    return (target.source, target.backend, draft.source if draft else "", draft.backend if draft else BACKENDS[0],
            n_ctx, target.n_gpu_layers is None, target.n_gpu_layers, target.n_threads or 0)


# -- the tab's views: widgets first (create_*), then their events (wire_*) -----------------------------------
ONE_LOAD = dict(concurrency_id=LOAD_QUEUE, concurrency_limit=1)


def build(engine):
    """The Models tab over `engine` in four views (sub-tabs, each sized for a laptop screen): Loaded & load,
    Library, Discover (Hugging Face search) and Downloads. Returns the ModelsUI; its `page_load` is the
    (handler, inputs, outputs) a page runs when it opens."""
    ui = ModelsUI(engine)
    library0 = ui.library()  # (rows, summary, target choices) as the page first shows them
    with gr.Tabs(selected=VIEW_LOAD, elem_id="models-views") as views:
        with gr.Tab("Loaded & load", id=VIEW_LOAD, elem_id="models-view-load"):
            w = create_load_view(ui, library0[2])
        with gr.Tab("Library", id=VIEW_LIBRARY, elem_id="models-view-library"):
            w |= create_library_view(library0[:2])
        hub_ui = downloads.create(ui)  # the Discover and Downloads views
    w["views"] = views
    wire_load_view(ui, w)
    wire_library_view(ui, w)
    hub_ui.wire(family=w["family"], target=w["target"], n_ctx=w["n_ctx"], draft=w["draft"], views=views,
                library=library_refresh(ui, w))
    ui.page_load = page_load(ui, w, hub_ui)
    return ui


def create_load_view(ui: ModelsUI, target_choices: list) -> dict:
    """Loaded & load: the load form and the memory plan of its load on the left; what is loaded, the load's
    stages and its status on the right."""
    with gr.Row(equal_height=False):
        with gr.Column(scale=5, min_width=520):
            w = create_load_form(ui, target_choices)
        with gr.Column(scale=4, min_width=400):
            w |= create_loaded(ui)
    return w


def create_load_form(ui: ModelsUI, target_choices: list) -> dict:
    """The load form: target and draft with their runtimes, the draft list's notes, context, GPU layers,
    threads, Load and Cancel, the memory plan of that load (open by itself when it warns), and what a load
    does to the models serving meanwhile."""
    target0, draft0 = _specs(ui.engine)
    choices, draft_value, notes0 = ui.drafts(target0.source if target0 else "", draft0.source if draft0 else "")
    w = {}
    with gr.Row():
        with gr.Column(min_width=240):
            w["target"] = gr.Dropdown(target_choices, value=target0.source if target0 else None,
                                      allow_custom_value=True, label="Target", info=SOURCE_HINT,
                                      elem_id="models-target")
            w["target_backend"] = gr.Radio(list(BACKENDS), value=target0.backend if target0 else BACKENDS[0],
                                           label="Target backend", elem_id="models-target-backend")
        with gr.Column(min_width=240):
            w["draft"] = gr.Dropdown(choices, value=draft_value, allow_custom_value=True,
                                     label="Draft (compatible files first)", elem_id="models-draft")
            w["draft_backend"] = gr.Radio(list(BACKENDS), value=draft0.backend if draft0 else BACKENDS[0],
                                          label="Draft backend", elem_id="models-draft-backend")
            w["family"] = gr.Button("Drafts of the same family on Hugging Face", size="sm", elem_id="models-family")
    w["draft_notes"] = gr.Markdown(notes0, elem_id="models-draft-notes", elem_classes="dsbd-small")
    manual = target0 is not None and target0.n_gpu_layers is not None
    with gr.Row():
        w["n_ctx"] = gr.Number(value=getattr(ui.engine, "n_ctx", 0) or (target0.n_ctx if target0 else 4096),
                               precision=0, label="Context (tokens)", elem_id="models-ctx", min_width=120)
        w["gpu_auto"] = gr.Checkbox(value=not manual, label="GPU layers from the plan",
                                    elem_id="models-gpu-auto", min_width=120)
        w["gpu_layers"] = gr.Number(value=target0.n_gpu_layers if manual else 0, precision=0,
                                    label="GPU layers (-1 = all)", elem_id="models-gpu-layers", interactive=manual,
                                    min_width=120)
        w["threads"] = gr.Number(value=(target0.n_threads or 0) if target0 else 0, precision=0,
                                 label="Threads (0 = auto)", elem_id="models-threads", min_width=120)
    with gr.Row():
        w["load"] = gr.Button("Load", variant="primary", elem_id="models-load")
        w["cancel"] = gr.Button("Cancel load", variant="stop", elem_id="models-cancel")
    plan0 = ui.form_plan(*_form_values(target0, draft0, w["n_ctx"].value)) if target0 else ""
    with gr.Accordion("Memory plan of this load", open=_warns(plan0), elem_id="models-form-plan-box") as box:
        w["form_plan"] = gr.Markdown(plan0, elem_id="models-form-plan")
    w["form_plan_box"] = box
    gr.Markdown(SWITCH_NOTE, elem_classes="dsbd-small")
    return w


def _warns(plan: str) -> bool:
    """Whether the form's memory plan says the load will not fit (or cannot be planned): then it opens."""
    return plan.startswith("⚠️")


def create_loaded(ui: ModelsUI) -> dict:
    """What is loaded (with its memory and Unload buttons), then the stages and status of a load."""
    first = ui.view()
    w = {"info": gr.Markdown(first.info, elem_id="models-info", elem_classes="dsbd-compact"),
         "memory": gr.Markdown(first.memory, elem_id="models-memory", elem_classes="dsbd-small")}
    with gr.Row():
        w["refresh"] = gr.Button("Refresh", size="sm", elem_id="models-refresh")
        w["unload_draft"] = gr.Button("Unload draft", size="sm", elem_id="models-unload-draft")
        w["unload_all"] = gr.Button("Unload all", size="sm", variant="stop", elem_id="models-unload")
    with gr.Accordion("Memory plan of the loaded models", open=False):
        gr.Markdown("At the default decoding settings.", elem_classes="dsbd-small")
        w["plan"] = gr.Markdown(first.plan, elem_id="models-plan")
    w["progress"] = gr.HTML("", elem_id="models-progress")
    w["status"] = gr.Markdown("", elem_id="models-status")
    return w


def create_library_view(first: tuple[list[list], str]) -> dict:
    """Library: the table of model files on this machine (`first`: its rows and summary); beside the selected
    file's card, its actions and the folders to scan."""
    rows0, summary0 = first
    w = {"summary": gr.Markdown(summary0, elem_id="models-library-summary", elem_classes="dsbd-small")}
    w["table"] = gr.Dataframe(rows0, headers=LIBRARY_HEADERS, datatype=LIBRARY_TYPES, interactive=False,
                              elem_id="models-library", wrap=True, max_height=250)
    with gr.Row(equal_height=False):
        with gr.Column(scale=2, min_width=400):
            w["selected"] = gr.Textbox(label="Selected file", interactive=False, max_lines=1,
                                       elem_id="models-selected")  # shown with ~ for the home folder
            w["selected_path"] = gr.State("")  # the file's path
            with gr.Row():
                w["use_target"] = gr.Button("Use as target", size="sm", elem_id="models-use-target")
                w["use_draft"] = gr.Button("Use as draft", size="sm", elem_id="models-use-draft")
                w["delete"] = gr.Button("Delete…", size="sm", variant="stop", elem_id="models-delete")
            with gr.Row(visible=False) as w["confirm"]:
                w["confirm_text"] = gr.Markdown(elem_id="models-delete-confirm-text")
                w["confirm_yes"] = gr.Button("Yes, delete", variant="stop", size="sm", elem_id="models-delete-yes")
                w["confirm_no"] = gr.Button("Keep it", size="sm", elem_id="models-delete-no")
            w["lib_status"] = gr.Markdown("", elem_id="models-library-status")
            with gr.Row():
                w["folder"] = gr.Textbox(label="Add a folder of models (scanned in place, nothing is copied)",
                                         scale=4, elem_id="models-folder")
                with gr.Column(scale=1, min_width=120):
                    w["add_folder"] = gr.Button("Add folder", size="sm", elem_id="models-add-folder")
                    w["rescan"] = gr.Button("Rescan", size="sm", elem_id="models-rescan")
        with gr.Column(scale=3, min_width=480):
            w["card"] = gr.Markdown("", elem_id="models-card", elem_classes="dsbd-compact")
    return w


def library_refresh(ui: ModelsUI, w: dict) -> tuple:
    """(handler, inputs, outputs) that redraw the library and the target list at the form's context and draft."""
    def update(*args):
        rows, summary, choices = ui.library(*args)
        return rows, summary, gr.update(choices=choices)
    return update, [w["n_ctx"], w["draft"]], [w["table"], w["summary"], w["target"]]


def _drafts_update(ui: ModelsUI):
    def update(target, draft):
        choices, keep, notes = ui.drafts(target, draft)
        return gr.update(choices=choices, value=keep), notes
    return update


def wire_load_view(ui: ModelsUI, w: dict) -> None:
    """The load form (Load, Cancel, the plan redrawn on every change, the draft list) and the Unload buttons."""
    form = [w[k] for k in ("target", "target_backend", "draft", "draft_backend", "n_ctx", "gpu_auto", "gpu_layers",
                           "threads")]
    loaded_out = [w["status"], w["info"], w["plan"], w["memory"]]
    lib_fn, lib_in, lib_out = library_refresh(ui, w)
    drafts = _drafts_update(ui)

    w["load"].click(ui.load, form, [w["progress"], *loaded_out], **ONE_LOAD, show_progress="hidden").then(
        lib_fn, lib_in, lib_out, **FAST)
    w["cancel"].click(ui.cancel_load, None, w["status"], **FAST)
    def form_plan(*values):
        text = ui.form_plan(*values)
        return text, gr.update(open=True) if _warns(text) else gr.skip()
    for c in form:
        c.change(form_plan, form, [w["form_plan"], w["form_plan_box"]], **FAST)
    w["target"].input(drafts, [w["target"], w["draft"]], [w["draft"], w["draft_notes"]], **FAST)
    w["gpu_auto"].change(lambda auto: gr.update(interactive=not auto), w["gpu_auto"], w["gpu_layers"], **FAST)
    w["n_ctx"].blur(lambda *a: ui.library(*a)[:2], lib_in, lib_out[:2], **FAST)
    w["refresh"].click(lambda: ui.view()._replace(status=gr.skip()), None, loaded_out, **FAST)
    w["unload_draft"].click(lambda: ui.unload("draft"), None, loaded_out, **ONE_LOAD)
    w["unload_all"].click(lambda: ui.unload("all"), None, loaded_out, **ONE_LOAD)


def wire_library_view(ui: ModelsUI, w: dict) -> None:
    """A row's card; Use as target / draft (they open the load form); Delete with confirmation; folders."""
    lib_fn, lib_in, lib_out = library_refresh(ui, w)
    to_form = gr.update(selected=VIEW_LOAD)  # the views' Tabs: open Loaded & load

    def on_row(evt: gr.SelectData):
        row = evt.row_value or []
        card, path = ui.card(row[0]) if row else ("", "")
        return card, tilde(path), path
    w["table"].select(on_row, None, [w["card"], w["selected"], w["selected_path"]], **FAST)
    w["use_target"].click(lambda p: (p, to_form) if p else (gr.skip(), gr.skip()), w["selected_path"],
                          [w["target"], w["views"]], **FAST).then(
        _drafts_update(ui), [w["target"], w["draft"]], [w["draft"], w["draft_notes"]], **FAST)
    w["use_draft"].click(lambda p: (p, to_form) if p else (gr.skip(), gr.skip()), w["selected_path"],
                         [w["draft"], w["views"]], **FAST)

    def ask_delete(path):
        text, ok = ui.delete_plan(path)
        return (gr.update(visible=True), text, "") if ok else (gr.update(visible=False), "", text)
    w["delete"].click(ask_delete, w["selected_path"], [w["confirm"], w["confirm_text"], w["lib_status"]], **FAST)
    w["confirm_no"].click(lambda: (gr.update(visible=False), "Kept."), None, [w["confirm"], w["lib_status"]],
                          **FAST)

    def do_delete(path, ctx, d):
        text, rows, summary, choices = ui.delete(path, ctx, d)
        return gr.update(visible=False), text, rows, summary, gr.update(choices=choices), "", "", ""
    w["confirm_yes"].click(do_delete, [w["selected_path"], *lib_in],
                           [w["confirm"], w["lib_status"], *lib_out, w["selected"], w["selected_path"], w["card"]],
                           **FAST)

    def do_add(path, ctx, d):
        text, rows, summary, choices = ui.add_folder(path, ctx, d)
        return text, rows, summary, gr.update(choices=choices)
    w["add_folder"].click(do_add, [w["folder"], *lib_in], [w["lib_status"], *lib_out], **FAST)
    w["rescan"].click(lib_fn, lib_in, lib_out, **FAST)


def page_load(ui: ModelsUI, w: dict, hub_ui) -> tuple:
    """(handler, inputs, outputs): a page opens on what is on disk and loaded now, not on what was there when
    the app started."""
    def on_open(ctx, t, d):
        rows, summary, choices = ui.library(ctx, d)
        drafts, keep, notes = ui.drafts(t, d)
        return (rows, summary, gr.update(choices=choices), gr.update(choices=drafts, value=keep), notes,
                *ui.view()[1:], *hub_ui.queue_view())
    outputs = [w["table"], w["summary"], w["target"], w["draft"], w["draft_notes"], w["info"], w["plan"],
               w["memory"], *hub_ui.queue_outputs]
    return on_open, [w["n_ctx"], w["target"], w["draft"]], outputs
