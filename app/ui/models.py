"""Models tab: what the engine has loaded, and how to change it."""

from __future__ import annotations

import gradio as gr

from .stats import memory_line

_LABELS = {"target": "Target model", "target_backend": "Target backend", "draft": "Draft model",
           "draft_backend": "Draft backend", "n_ctx": "Context window (tokens)"}
SWITCH_NOTE = ("Model switching from the UI: use `--target` / `--draft` on the command line "
               "(a preset such as `tiny`, a local `.gguf` file or folder, or a Hugging Face repo) and restart "
               "`dsbd-chat`; saved chats stay in the history.")


def describe_markdown(engine) -> str:
    """engine.describe() as a two-column table, plus a note when no draft model is loaded."""
    try:
        info = engine.describe()
    except Exception as e:  # a half-loaded engine must still let the page open
        return f"⚠️ could not describe the engine: {e}"
    rows = "\n".join(f"| {_LABELS.get(k, k)} | `{v}` |" for k, v in info.items())
    md = "| | loaded |\n|---|---|\n" + rows
    if "draft" not in info:
        md += "\n\nNo draft model: modes sps, dsbd and dsbd-mem need one (`--draft`)."
    return md


def build(engine) -> None:
    gr.Markdown("### Loaded models")
    info = gr.Markdown(describe_markdown(engine), elem_id="models-info")
    mem = gr.Markdown(memory_line(), elem_id="models-memory")
    gr.Markdown(SWITCH_NOTE)
    refresh = gr.Button("Refresh", size="sm")
    refresh.click(lambda: (describe_markdown(engine), memory_line()), None, [info, mem], concurrency_limit=None,
                  show_progress="hidden")
