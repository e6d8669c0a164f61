"""Chat tab: streamed answers, Stop / Regenerate / Edit / New chat, history sidebar, stats and forest.

Handlers are methods of `ChatUI` taking a `Session` (one per browser tab) plus widget values, and
returning or yielding a `ChatView` (one value per output widget), so tests drive them without a server.
Every engine-running event shares one concurrency group: one generation at a time, the rest queue.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Iterator, NamedTuple

import gradio as gr

from backends.base import BackendError

from app.config import ConfigError
from app.engine.interface import PromptTooLong
from app.serve.ui.forest import forest_svg, origin_html
from app.storage import CorruptChat, HistoryError, HistoryStore, title_of
from app.serve.ui.settings import (FIELDS, DecodingPanel, default_settings, params_from, settings_from_values, summary,
                       widget_updates)
from app.serve.ui.stats import memory_line, stats_footer, stats_markdown

log = logging.getLogger(__name__)
ENGINE_QUEUE = "engine"  # concurrency_id of every event that runs the engine
_FOREST_EVERY_S = 0.3  # redraw the forest at most this often while streaming


class Session:
    """One browser tab: its open chat, the cancel Event of its current generation, and pending actions."""

    def __init__(self) -> None:
        self.chat: dict | None = None
        self.cancel = threading.Event()  # replaced by a fresh Event for every generation
        self.pending = False  # a user turn waits for an answer
        self.editing = False  # the next Send replaces the last user turn
        self.auto_drop = False  # the next answer may drop the oldest turns to fit the context
        self.error: str | None = None  # shown as an error bubble until the next action
        self.too_long = False

    def __deepcopy__(self, memo):
        # Gradio deep-copies State values per session; the factory already made this one fresh,
        # and a threading.Event cannot be copied.
        return self


class ChatView(NamedTuple):
    """One value per output widget, in the order `build` wires them; gr.skip() leaves a widget as it is."""

    chatbot: object
    textbox: object
    status: object
    stats: object
    forest: object
    drop: object
    chats: object
    system: object
    title: object


def skip_view(**changes) -> ChatView:
    return ChatView(**({f: gr.skip() for f in ChatView._fields} | changes))


def prompt_messages(chat: dict) -> list[dict]:
    """What the model sees: the system prompt and the turns from `context_from` on."""
    sys_msg = [{"role": "system", "content": chat["system"]}] if chat.get("system", "").strip() else []
    turns = chat["messages"][chat.get("context_from", 0):]
    return sys_msg + [{"role": m["role"], "content": m["content"]} for m in turns]


def drop_oldest_pair(chat: dict) -> bool:
    """Move the context start past the oldest user turn (and its answer); the last user turn always stays."""
    msgs, start = chat["messages"], chat.get("context_from", 0)
    users = [i for i, m in enumerate(msgs) if m["role"] == "user" and i > start]
    if not users:
        return False
    chat["context_from"] = users[0]
    return True


class ChatUI:
    """Handlers of the Chat tab over one engine and one history store."""

    def __init__(self, engine, store: HistoryStore, panel_updates=widget_updates) -> None:
        self.engine, self.store = engine, store
        self.panel_updates = panel_updates  # settings dict -> one update per decoding-panel widget

    @property
    def decode(self):
        """The engine's current tokenizer's decode: looked up each time, the Models tab can swap models."""
        return getattr(getattr(self.engine, "tokenizer", None), "decode", None)

    # -- rendering -------------------------------------------------------------------------------
    def display(self, session: Session, partial: str | None = None, live: int = 0) -> list[dict]:
        """Chatbot messages: the chat, a streaming bubble, an error bubble."""
        chat, out = session.chat, []
        if chat is None:
            return out
        cut = chat.get("context_from", 0)
        for i, m in enumerate(chat["messages"]):
            if i == cut and cut > 0:
                out.append({"role": "assistant", "content": f"*— the {cut} message(s) above are kept here "
                                                            "but no longer sent to the model —*"})
            text = m["content"]
            if m["role"] == "assistant" and m.get("stats"):
                text += f"\n\n<sub>{stats_footer(m['stats'])}</sub>"
            out.append({"role": m["role"], "content": text})
        if partial is not None:
            text = partial + " ▍"
            if live > 1:
                text += f"\n\n*⏳ deciding between {live} beams…*"
            out.append({"role": "assistant", "content": text})
        if session.error:
            out.append({"role": "assistant", "content": f"⚠️ **Error:** {session.error}"})
        return out

    def chat_list(self, session: Session, notices: list[str] | None = None):
        items, found = self.store.list_chats()
        if notices is not None:
            notices.extend(found)
        current = session.chat["id"] if session.chat else None
        ids = {c["id"] for c in items}
        choices = [(f"{c['title']} · {time.strftime('%b %d %H:%M', time.localtime(c['updated']))}", c["id"])
                   for c in items]
        return gr.update(choices=choices, value=current if current in ids else None)

    def view(self, session: Session, **changes) -> ChatView:
        base = {"chatbot": self.display(session), "drop": gr.update(visible=session.too_long)}
        return skip_view(**(base | changes))

    def _ensure_chat(self, session: Session, system: str, settings: dict) -> dict:
        if session.chat is None:
            session.chat = self.store.new_chat(system=system, settings=settings)
        session.chat["system"], session.chat["settings"] = system or "", settings
        return session.chat

    def _save(self, chat: dict) -> str:
        try:
            self.store.save(chat)
            return ""
        except (OSError, HistoryError) as e:
            return f" (could not save the chat: {e})"

    # -- turn preparation (fast, run outside the engine queue) ------------------------------------
    def submit(self, session: Session, text: str, system: str, *values) -> ChatView:
        """Add the user's message (or replace the last one when editing) and mark an answer pending."""
        text = (text or "").strip()
        if not text:
            return self.view(session, status="Type a message first.")
        chat = self._ensure_chat(session, system, settings_from_values(*values))
        msgs = chat["messages"]
        if session.editing and any(m["role"] == "user" for m in msgs):
            last = max(i for i, m in enumerate(msgs) if m["role"] == "user")
            del msgs[last:]
            chat["context_from"] = min(chat.get("context_from", 0), last)
        session.editing = False
        msgs.append({"role": "user", "content": text})
        session.pending, session.error, session.too_long, session.auto_drop = True, None, False, False
        return self.view(session, textbox="", status="Waiting for the engine…")

    def regenerate(self, session: Session, system: str, *values) -> ChatView:
        """Drop the last answer and mark a new one pending."""
        chat = session.chat
        if chat is None or not any(m["role"] == "user" for m in chat["messages"]):
            return self.view(session, status="Nothing to regenerate yet.")
        self._ensure_chat(session, system, settings_from_values(*values))
        while chat["messages"] and chat["messages"][-1]["role"] == "assistant":
            chat["messages"].pop()
        session.pending, session.error, session.too_long, session.auto_drop = True, None, False, False
        return self.view(session, status="Regenerating…")

    def start_edit(self, session: Session) -> ChatView:
        """Put the last user message in the textbox; the next Send replaces it and everything after it."""
        msgs = session.chat["messages"] if session.chat else []
        users = [m for m in msgs if m["role"] == "user"]
        if not users:
            return self.view(session, status="No message to edit yet.")
        session.editing = True
        return self.view(session, textbox=users[-1]["content"],
                         status="Editing your last message: change it and press Send to resend.")

    def drop_and_retry(self, session: Session, system: str, *values) -> ChatView:
        """After PromptTooLong: retry, dropping the oldest turns from the context until the prompt fits."""
        if session.chat is None or not session.chat["messages"]:
            return self.view(session, status="Nothing to retry.")
        self._ensure_chat(session, system, settings_from_values(*values))
        session.pending, session.auto_drop, session.error, session.too_long = True, True, None, False
        return self.view(session, status="Retrying without the oldest turns…")

    def stop(self, session: Session) -> str:
        """Stop this tab's generation only (or its queued request)."""
        session.cancel.set()
        if session.pending:  # still queued: the answer will not start
            session.pending = False
            return "Cancelled before it started."
        return "Stopping…"

    # -- the answer (runs in the engine queue) ---------------------------------------------------
    def generate(self, session: Session) -> Iterator[ChatView]:
        """Stream the pending answer of this tab's chat; errors become an error bubble."""
        if not session.pending or session.chat is None:
            yield skip_view()
            return
        session.cancel = cancel = threading.Event()  # one per generation: Stop never hits a later one
        session.pending = False
        chat = session.chat
        settings = default_settings() | chat["settings"]
        stream, dropped, last, forest = None, 0, None, None
        t0, t_draw = time.perf_counter(), 0.0
        try:
            stream, first, dropped = self._open(session, chat, settings, cancel)
            note = f"Dropped the {dropped} oldest turn(s) from the context so the prompt fits. " if dropped else ""
            for ev in itertools.chain([first] if first is not None else [], stream):
                if ev.error:
                    raise BackendError(ev.error)
                last = ev
                forest = ev.forest or forest
                if ev.done:
                    break
                now = time.perf_counter()
                drawn = gr.skip()
                if ev.forest is not None and now - t_draw >= _FOREST_EVERY_S:
                    drawn, t_draw = forest_svg(forest, self.decode), now
                status = (f"{note}Deciding between {ev.live_beams} beams… ({ev.tokens} tokens final)"
                          if ev.live_beams > 1 else f"{note}Generating… {ev.tokens} tokens")
                yield self.view(session, chatbot=self.display(session, ev.text, ev.live_beams), status=status,
                                stats=f"{ev.tokens} tokens · {now - t0:.1f} s  \n{memory_line()}", forest=drawn)
        except PromptTooLong as e:
            session.error, session.too_long = f"{e}", True
        except (ConfigError, ValueError, BackendError) as e:  # ChatError is a ValueError
            session.error = str(e)
        except Exception as e:  # never let a bug take the tab down; the log has the traceback
            log.exception("generation failed")
            session.error = f"internal error: {type(e).__name__}: {e}"
        finally:
            if hasattr(stream, "close"):
                stream.close()  # releases the engine lock even when the client went away
            session.auto_drop = False
        if session.error:  # the question stays in the history, ready for Regenerate
            saved = self._save(chat)
            yield self.view(session, status=f"Failed: {session.error}{saved}", chats=self.chat_list(session))
            return
        if last is None:
            yield self.view(session, status="The engine returned nothing.")
            return
        stats = last.stats or {}
        chat["messages"].append({"role": "assistant", "content": last.text, "stats": stats,
                                 "settings": summary(settings)})
        saved = self._save(chat)
        stopped = stats.get("finish_reason") == "cancelled" or (cancel.is_set() and not last.done)
        status = (f"Stopped after {last.tokens} tokens." if stopped
                  else f"Done: {last.tokens} tokens in {time.perf_counter() - t0:.1f} s.")
        if dropped:
            status = f"Dropped the {dropped} oldest turn(s) from the context. " + status
        if stats.get("notice"):  # the engine changed the request to fit memory: say so
            status = f"Note: {stats['notice']}. " + status
        yield self.view(session, status=status + saved, stats=stats_markdown(stats),
                        forest=forest_svg(forest, self.decode) + origin_html(last.segments),
                        chats=self.chat_list(session))

    def _open(self, session: Session, chat: dict, settings: dict, cancel: threading.Event):
        """Start the engine stream and take its first event; with auto_drop, drop oldest turns on PromptTooLong."""
        params, dropped = params_from(settings), 0
        while True:
            stream = None
            try:
                stream = iter(self.engine.chat(prompt_messages(chat), params, cancel=cancel))
                return stream, next(stream, None), dropped
            except PromptTooLong:
                if stream is not None and hasattr(stream, "close"):
                    stream.close()
                if session.auto_drop and drop_oldest_pair(chat):
                    dropped += 1
                    continue
                raise

    # -- history ---------------------------------------------------------------------------------
    def new_chat(self, session: Session, system: str, *values) -> tuple:
        """Start an empty chat with the current settings (stops this tab's running answer)."""
        session.cancel.set()
        session.chat = self.store.new_chat(system=system or "", settings=settings_from_values(*values))
        session.pending = session.editing = session.too_long = False
        session.error = None
        return self.view(session, textbox="", status="New chat.", stats="", forest=forest_svg(None),
                         chats=self.chat_list(session), title="")

    def open_chat(self, session: Session, chat_id: str | None) -> tuple:
        """Reopen a saved chat: messages, system prompt, and its decoding settings (extra outputs)."""
        if not chat_id:
            return (*self.view(session), *self._no_panel())
        notices: list[str] = []
        try:
            chat = self.store.load(chat_id)
        except CorruptChat as e:
            return (*self.view(session, status=str(e), chats=self.chat_list(session)), *self._no_panel())
        except HistoryError as e:
            return (*self.view(session, status=str(e), chats=self.chat_list(session)), *self._no_panel())
        session.cancel.set()  # an answer still streaming belongs to the chat we leave
        session.chat = chat
        session.pending = session.editing = session.too_long = False
        session.error = None
        last_stats = next((m.get("stats") for m in reversed(chat["messages"]) if m["role"] == "assistant"), None)
        view = self.view(session, textbox="", status=f"Opened “{title_of(chat)}”.",
                         stats=stats_markdown(last_stats), forest=forest_svg(None),
                         chats=self.chat_list(session, notices), system=chat["system"], title=chat.get("title", ""))
        if notices:
            view = view._replace(status=view.status + " " + " ".join(notices))
        return (*view, *self.panel_updates(chat["settings"]))

    def rename(self, session: Session, title: str) -> ChatView:
        if session.chat is None:
            return self.view(session, status="Nothing to rename: start a chat first.")
        session.chat["title"] = " ".join((title or "").split())[:120]
        saved = self._save(session.chat)
        return self.view(session, status=f"Renamed to “{title_of(session.chat)}”.{saved}",
                         chats=self.chat_list(session))

    def delete(self, session: Session, system: str, *values) -> ChatView:
        """Delete the open chat's file and start a new chat."""
        if session.chat is None:
            return self.view(session, status="Nothing to delete.")
        old = title_of(session.chat)
        try:
            self.store.delete(session.chat["id"])
        except (OSError, HistoryError) as e:
            return self.view(session, status=f"Could not delete: {e}")
        view = self.new_chat(session, system, *values)
        return view._replace(status=f"Deleted “{old}”.")

    def export(self, session: Session, fmt: str):
        """(file update, status) for the export of the open chat as JSON or Markdown."""
        if session.chat is None or not session.chat["messages"]:
            return gr.update(visible=False), "Nothing to export yet."
        try:
            path = self.store.export(session.chat, fmt)
        except (OSError, HistoryError) as e:
            return gr.update(visible=False), f"Export failed: {e}"
        return gr.update(value=str(path), visible=True), f"Exported to {path.name}."

    def on_load(self, session: Session) -> ChatView:
        notices: list[str] = []
        chats = self.chat_list(session, notices)
        return self.view(session, chats=chats, status=" ".join(notices) or gr.skip())

    def _no_panel(self) -> list:
        return [gr.skip()] * len(FIELDS)


# -- layout ----------------------------------------------------------------------------------------
def build(engine, store: HistoryStore, session: gr.State):
    """Create the Chat tab's widgets and events inside the current Blocks.

    Returns (ui, panel, system prompt box, the ChatView output widgets) for the other tabs and page load.
    """
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=220, elem_id="history-column"):
            gr.Markdown("### Chats")
            new_btn = gr.Button("+ New chat", elem_id="new-chat", size="sm")
            chats = gr.Radio(choices=[], label="Saved chats", elem_id="chat-list", show_label=False)
            title = gr.Textbox(label="Title", placeholder="Rename this chat…", elem_id="chat-title", max_lines=1)
            with gr.Row():
                rename_btn = gr.Button("Rename", size="sm", elem_id="rename")
                delete_btn = gr.Button("Delete", size="sm", variant="stop", elem_id="delete")
            with gr.Row():
                json_btn = gr.Button("Export JSON", size="sm", elem_id="export-json")
                md_btn = gr.Button("Export Markdown", size="sm", elem_id="export-md")
            export_file = gr.File(label="Export", visible=False, interactive=False, elem_id="export-file")
        with gr.Column(scale=4, min_width=420):
            chatbot = gr.Chatbot(label="Chat", height=460, elem_id="chatbot", buttons=["copy"],
                                 placeholder="Ask something. Answers stream in as the beams agree.")
            status = gr.Markdown("", elem_id="status")
            text = gr.Textbox(placeholder="Message (Enter to send, Shift+Enter for a new line)", show_label=False,
                              lines=2, max_lines=8, elem_id="message", autofocus=True)
            with gr.Row():
                send_btn = gr.Button("Send", variant="primary", elem_id="send")
                stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
                regen_btn = gr.Button("Regenerate", elem_id="regenerate")
                edit_btn = gr.Button("Edit last", elem_id="edit")
                drop_btn = gr.Button("Drop oldest turns & retry", visible=False, elem_id="drop-oldest")
            stats = gr.Markdown(memory_line(), elem_id="stats", elem_classes=["dsbd-stats"])
            with gr.Accordion("Draft forest (latest DSBD iteration) · answer by origin", open=True):
                forest = gr.HTML(forest_svg(None), elem_id="forest")
        with gr.Column(scale=2, min_width=260, elem_id="settings-column"):
            system = gr.Textbox(label="System prompt", lines=3, placeholder="You are a helpful assistant.",
                                elem_id="system")
            panel = DecodingPanel()
    ui = ChatUI(engine, store, panel.updates)
    outputs = [chatbot, text, status, stats, forest, drop_btn, chats, system, title]
    fast = dict(concurrency_limit=None, show_progress="hidden")  # never waits behind a running answer
    # queue position and timer on the chatbot only, not on every output widget
    gen = dict(concurrency_id=ENGINE_QUEUE, concurrency_limit=1, show_progress="minimal", show_progress_on=[chatbot])
    values = [session, system, *panel.components]

    def answer(trigger, prepare, inputs):
        return trigger(prepare, inputs, outputs, **fast).then(ui.generate, [session], outputs, **gen)

    answer(text.submit, ui.submit, [session, text, system, *panel.components])
    answer(send_btn.click, ui.submit, [session, text, system, *panel.components])
    answer(regen_btn.click, ui.regenerate, values)
    answer(drop_btn.click, ui.drop_and_retry, values)
    stop_btn.click(ui.stop, [session], [status], **fast)
    edit_btn.click(ui.start_edit, [session], outputs, **fast)
    new_btn.click(ui.new_chat, values, outputs, **fast)
    chatbot.clear(ui.new_chat, values, outputs, **fast)  # the chatbot's own trash icon = a new chat
    chats.input(ui.open_chat, [session, chats], outputs + panel.components, **fast)
    rename_btn.click(ui.rename, [session, title], outputs, **fast)
    title.submit(ui.rename, [session, title], outputs, **fast)
    delete_btn.click(ui.delete, values, outputs, **fast)
    json_btn.click(lambda s: ui.export(s, "json"), [session], [export_file, status], **fast)
    md_btn.click(lambda s: ui.export(s, "md"), [session], [export_file, status], **fast)
    return ui, panel, system, outputs
