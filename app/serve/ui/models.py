"""Models tab: what the engine has loaded (with its memory plan), the presets, and a form to switch models.

Handlers are methods of `ModelsUI` returning a `ModelsView` (one value per output widget), so tests drive
them without a server. A load goes through `engine.swap`: the new models load beside the serving ones and
replace them only once both loaded and their vocabularies match; any failure keeps the old ones serving.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import NamedTuple

import gradio as gr

from backends.base import BackendError
from backends.presets import PRESETS
from backends.tokenizer import VocabMismatch

from app.config import ConfigError
from backends.registry import BACKENDS, ModelSpec
from app.serve.ui.settings import default_settings, params_from
from app.serve.ui.stats import memory_line

log = logging.getLogger(__name__)
LOAD_QUEUE = "model-load"  # its own concurrency group: a load neither waits behind nor blocks the answers
SOURCE_HINT = ("a preset (tiny, qwen-coder), a local .gguf file, a safetensors folder, or a Hugging Face "
               "id org/name or org/name:file.gguf")
_LABELS = {"target": "Target model", "target_backend": "Target backend", "target_source": "Target source",
           "draft": "Draft model", "draft_backend": "Draft backend", "draft_source": "Draft source",
           "n_ctx": "Context window (tokens)", "target_placement": "Target placement (RPC workers)",
           "draft_placement": "Draft placement"}
SWITCH_NOTE = ("Same as `--target` / `--draft` with `--target-backend` / `--draft-backend` on the command line; "
               "context size, dtype, device and threads stay as loaded. The current models keep answering "
               "while the new ones load, and stay if anything fails.")
PRESET_HEADERS = ["preset", "role", "model", "size", "installed", "status", "install"]


class ModelsView(NamedTuple):
    """What a Models-tab handler returns, in output-widget order."""

    status: str
    info: str
    plan: str
    presets: list[list]
    memory: str


def _specs(engine) -> tuple[ModelSpec | None, ModelSpec | None]:
    return getattr(engine, "specs", None) or (None, None)  # engines built without specs (tests) have none


def describe_markdown(engine) -> str:
    """engine.describe() (plus where each model came from) as a table; a note when no draft is loaded."""
    try:
        info = engine.describe()
    except Exception as e:  # a half-loaded engine must still let the page open
        return f"⚠️ could not describe the engine: {e}"
    target, draft = _specs(engine)
    info |= {"target_source": target.source} if target else {}
    info |= {"draft_source": draft.source} if draft and "draft" in info else {}
    rows = "\n".join(f"| {_LABELS.get(k, k)} | `{v}` |" for k, v in info.items())
    md = "| | loaded |\n|---|---|\n" + rows
    if "draft" not in info:
        md += "\n\nNo draft model: modes sps, dsbd and dsbd-mem need one (load one below, or `--draft`)."
    return md


def plan_markdown(engine) -> str:
    """The memory plan of the loaded specs at the default decoding settings, or why not."""
    target, draft = _specs(engine)
    if target is None:
        return "No memory plan: the engine was not loaded from model specs."
    from app.engine.planning import PlanError, plan_for  # lazy: reading free VRAM may import torch

    try:
        plan = plan_for(target, draft, params_from(default_settings()))
    except PlanError as e:
        return f"⚠️ {e}"
    except Exception as e:  # the plan is advice: a failure must not break the tab
        return f"No memory plan for these models: {e}"
    return f"```text\n{plan.format()}\n```"


def preset_rows() -> list[list]:
    """backends.presets.list_models() as table rows (markers only: never hashes a file)."""
    from backends.presets import list_models

    try:
        rows = list_models()
    except Exception as e:  # a broken cache folder must not break the tab
        return [[f"⚠️ {e}", "", "", "", "", "", ""]]
    return [[r["preset"], r["role"], r["name"], f"{r['size'] / 1e6:,.0f} MB", "yes" if r["installed"] else "no",
             r["status"], r["install"]] for r in rows]


def loaded_summary(info: dict) -> str:
    text = f"target {info['target']} ({info['target_backend']})"
    if "draft" in info:
        text += f" + draft {info['draft']} ({info['draft_backend']})"
    return text + f", context {info['n_ctx']}"


class ModelsUI:
    """Handlers of the Models tab over one engine."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def view(self, status: str = "") -> ModelsView:
        return ModelsView(status, describe_markdown(self.engine), plan_markdown(self.engine), preset_rows(),
                          memory_line())

    def specs_from(self, target: str, target_backend: str, draft: str, draft_backend: str):
        """Form values -> (target, draft or None) specs; the rest of each spec stays as loaded."""
        old_t, old_d = _specs(self.engine)
        base = old_t or ModelSpec(source="", n_ctx=getattr(self.engine, "n_ctx", 4096))
        target, draft = (target or "").strip(), (draft or "").strip()
        if not target:
            raise ConfigError(f"enter a target model: {SOURCE_HINT}")
        t = replace(base, source=target, backend=target_backend or base.backend).validated()
        if not draft:
            return t, None
        d_base = old_d or base  # the CLI gives both roles the same threads / device / context
        # RPC workers (set by --rpc, never from this form) hold the target only: the draft stays local.
        return t, replace(d_base, source=draft, backend=draft_backend or d_base.backend, rpc=()).validated()

    def load(self, target: str, target_backend: str, draft: str, draft_backend: str,
             progress=gr.Progress(track_tqdm=True)) -> ModelsView:  # noqa: B008 (Gradio injects it)
        """Load the form's models and swap them in; on failure say why and keep serving the old ones."""
        try:
            specs = self.specs_from(target, target_backend, draft, draft_backend)
            info = self.engine.swap(*specs, progress=progress)
        except Exception as e:
            if not isinstance(e, (BackendError, ConfigError)):
                log.exception("loading models failed")
            hint = " Pick a draft of the target's model family." if isinstance(e, VocabMismatch) else ""
            why = str(e).rstrip(".") or type(e).__name__
            return self.view(f"⚠️ Could not load: {why}.{hint}\n\nStill serving the previous models.")
        return self.view(f"✅ Loaded {loaded_summary(info)}.")


def build(engine) -> ModelsUI:
    """Create the Models tab's widgets over `engine`."""
    ui = ModelsUI(engine)
    first = ui.view()
    target0, draft0 = _specs(engine)
    gr.Markdown("### Loaded models")
    info = gr.Markdown(first.info, elem_id="models-info")
    mem = gr.Markdown(first.memory, elem_id="models-memory")
    with gr.Accordion("Memory plan (at the default decoding settings)", open=False):
        plan = gr.Markdown(first.plan, elem_id="models-plan")
    refresh = gr.Button("Refresh", size="sm")

    gr.Markdown("### Load models")
    preset = gr.Dropdown(["", *PRESETS], value="", label="Fill from preset", elem_id="models-preset")
    with gr.Row():
        with gr.Column():
            target = gr.Textbox(label="Target", value=target0.source if target0 else "", placeholder=SOURCE_HINT,
                                elem_id="models-target")
            target_backend = gr.Radio(list(BACKENDS), value=target0.backend if target0 else BACKENDS[0],
                                      label="Target backend", elem_id="models-target-backend")
        with gr.Column():
            draft = gr.Textbox(label="Draft (empty: none)", value=draft0.source if draft0 else "",
                               placeholder=SOURCE_HINT, elem_id="models-draft")
            draft_backend = gr.Radio(list(BACKENDS), value=draft0.backend if draft0 else BACKENDS[0],
                                     label="Draft backend", elem_id="models-draft-backend")
    gr.Markdown(SWITCH_NOTE)
    load_btn = gr.Button("Load", variant="primary", elem_id="models-load")
    status = gr.Markdown("", elem_id="models-status")

    gr.Markdown("### Presets")
    presets = gr.Dataframe(first.presets, headers=PRESET_HEADERS, interactive=False, elem_id="models-presets")

    outputs = [status, info, plan, presets, mem]
    load_btn.click(ui.load, [target, target_backend, draft, draft_backend], outputs, concurrency_id=LOAD_QUEUE,
                   concurrency_limit=1, show_progress_on=[status])
    preset.input(lambda p: (p, p) if p else (gr.skip(), gr.skip()), [preset], [target, draft],
                 concurrency_limit=None, show_progress="hidden")
    refresh.click(lambda: ui.view()._replace(status=gr.skip()), None, outputs, concurrency_limit=None,
                  show_progress="hidden")
    return ui
