"""Chat tab: streamed answers, Stop / Regenerate / Edit / New chat, history sidebar, stats and forest; attached
files (button, drag and drop, paste) with their token budget, and answers that rewrite a file shown as diffs.

Handlers are methods of `ChatUI` taking a `Session` (one per browser tab) plus widget values, and
returning or yielding a `ChatView` (one value per output widget), so tests drive them without a server.
Every engine-running event shares one concurrency group: one generation at a time, the rest queue.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from typing import Iterator, NamedTuple

import gradio as gr

from backends.base import BackendError

from app import attachments as att
from app.config import ConfigError
from app.engine.interface import NoModelLoaded, PromptTooLong
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
    patched: object  # the latest answer's patched files (download)
    files: object  # the message box's files: name, size, tokens, and the context budget


EMPTY_BOX = {"text": "", "files": []}


def skip_view(**changes) -> ChatView:
    return ChatView(**({f: gr.skip() for f in ChatView._fields} | changes))


def turns_in_context(chat: dict | None, system: str) -> list[dict]:
    """The system prompt and the turns of `chat` the model sees (from `context_from` on), as stored."""
    sys_msg = [{"role": "system", "content": system}] if (system or "").strip() else []
    return sys_msg + (chat["messages"][chat.get("context_from", 0):] if chat is not None else [])


def prompt_messages(chat: dict, window: att.Window | None = None) -> list[dict]:
    """What the model sees: the system prompt and the turns from `context_from` on, each user turn with its files
    (whole, or the passages chosen when it was sent)."""
    return att.chat_prompt(turns_in_context(chat, chat.get("system", "")), window).messages


def context_files(chat: dict | None) -> list[att.Attachment]:
    """The files of the turns the model sees, the newest of each name (what an answer's code may rewrite)."""
    if chat is None:
        return []
    latest: dict[str, att.Attachment] = {}
    for m in chat["messages"][chat.get("context_from", 0):]:
        for a in att.message_files(m):
            latest.pop(a.name, None)
            latest[a.name] = a
    return list(latest.values())


def box_value(value) -> tuple[str, list[str]]:
    """The message box's value (a MultimodalTextbox dict, or plain text) -> (text, uploaded file paths)."""
    if isinstance(value, dict):
        files = [f if isinstance(f, str) else (f.get("path") if isinstance(f, dict) else getattr(f, "path", None))
                 for f in value.get("files") or []]
        return str(value.get("text") or ""), [f for f in files if f]
    return str(value or ""), []


def files_line(m: dict) -> str:
    """The chips under a user turn: each file with its size, and what of it went into the prompt."""
    files = att.message_files(m)
    if not files:
        return ""
    plan = att.ContextPlan.from_dict(m.get("context"))
    used: dict[str, list[str]] = {}
    for p in (plan.parts or []) if plan is not None and plan.retrieved else []:
        used.setdefault(p.name, []).append(f"{p.start}-{p.end}")
    chips = []
    for a in files:
        if plan is None or not plan.retrieved:
            what = "whole"
        else:
            what = f"lines {', '.join(used[a.name])}" if a.name in used else "not used"
        chips.append(f"📎 `{a.name}` · {att.format_bytes(a.size)} · {what}")
    head = f"*{plan.describe(files)}*  \n" if plan is not None else ""
    return "\n\n" + head + "  \n".join(chips)


def diff_markdown(diffs: list[dict]) -> str:
    out = []
    for d in diffs:
        out.append(f"**Changes to `{d['name']}`** (+{d['added']} −{d['removed']}):\n{att.fenced(d['diff'], 'diff')}")
    return "\n\n" + "\n\n".join(out) if out else ""


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
        self._read: dict[tuple, tuple] = {}  # (path, size, mtime) -> (Attachment | AttachmentError, tokens)

    # -- files -----------------------------------------------------------------------------------
    def count(self, text: str) -> int:
        """Tokens of `text` with the loaded model's tokenizer (about 4 characters a token without one)."""
        encode = getattr(getattr(self.engine, "tokenizer", None), "encode", None)
        if encode is None:
            return att.estimate_tokens(text)
        try:
            return len(encode(text))
        except NoModelLoaded:
            return att.estimate_tokens(text)

    def read_files(self, paths: list[str]) -> list[tuple[att.Attachment | att.AttachmentError, int]]:
        """Each uploaded file read once (cached by path, size and time): (file or its error, its tokens)."""
        out = []
        for path in paths:
            try:
                st = os.stat(path)
                key = (path, st.st_size, st.st_mtime_ns)
            except OSError:
                key = (path, -1, -1)
            if key not in self._read:
                try:
                    a = att.read_path(path)
                    self._read[key] = (a, self.count(att.render_whole(a)))
                except att.AttachmentError as e:
                    self._read[key] = (e, 0)
                if len(self._read) > 256:  # uploads of long sessions: keep the newest
                    self._read.pop(next(iter(self._read)))
            out.append(self._read[key])
        return out

    def measure(self, messages: list[dict]) -> int:
        """Tokens of chat messages as the loaded model's template renders them (estimated without a model)."""
        try:
            return len(self.engine.encode(messages))
        except (NoModelLoaded, AttributeError, ValueError):
            return sum(att.estimate_tokens(m["content"]) + 4 for m in messages)

    @property
    def n_ctx(self) -> int:
        return int(getattr(self.engine, "n_ctx", 4096) or 4096)

    def window(self, params) -> att.Window:
        """The context a turn's files are fitted into for an answer with these DecodeParams."""
        return att.Window(n_ctx=self.n_ctx, reserve=att.answer_reserve(params), measure=self.measure,
                          count=self.count)

    def _history_tokens(self, chat: dict | None, system: str, text: str) -> int:
        """Tokens of the prompt without the new files: system prompt, the turns in context, the new text."""
        turns = att.chat_prompt(turns_in_context(chat, system)).messages
        return self.measure(turns + [{"role": "user", "content": text}])

    def preview(self, session: Session, box, system: str, *values) -> str:
        """The message box's files as chips (name, size, tokens; errors named) and the context budget."""
        text, paths = box_value(box)
        if not paths:
            return ""
        read = self.read_files(paths)
        lines = [f"📎 `{a.name}` · {att.format_bytes(a.size)} · {tokens:,} tokens" if isinstance(a, att.Attachment)
                 else f"⚠️ {a} (it will not be sent: remove it)" for a, tokens in read]
        files = att.unique_names([a for a, _ in read if isinstance(a, att.Attachment)])
        if len(paths) > att.MAX_FILES:
            lines.append(f"⚠️ {len(paths)} files: at most {att.MAX_FILES} per message")
        if files:  # priced from the cached counts: this runs as the text is typed (retrieval runs on Send)
            try:
                budget = att.Budget(files=sum(t for a, t in read if isinstance(a, att.Attachment)),
                                    history=self._history_tokens(session.chat, system, text),
                                    answer=att.answer_reserve(params_from(settings_from_values(*values))),
                                    n_ctx=self.n_ctx)
                lines.append(budget.line())
            except (ConfigError, ValueError) as e:
                lines.append(f"Context budget unknown: {e}")
        return "  \n".join(lines)

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
            if m["role"] == "user":
                text += files_line(m)
            if m["role"] == "assistant" and m.get("diffs"):
                text += diff_markdown(m["diffs"])
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
    def submit(self, session: Session, box, system: str, *values) -> ChatView:
        """Add the user's message with its files (or replace the last one when editing; its files stay unless
        others are attached) and mark an answer pending. Files go in whole when they fit the context, else the
        passages the text needs; a file that cannot be read stops the message with the reason."""
        text, paths = box_value(box)
        text = text.strip()
        if not text and not paths:
            return self.view(session, status="Type a message first.")
        try:
            att.check_count(len(paths))
        except att.AttachmentError as e:
            return self.view(session, status=f"Not sent: {e}.")
        read = self.read_files(paths)
        bad = [str(a) for a, _ in read if isinstance(a, att.AttachmentError)]
        if bad:
            return self.view(session, status="Not sent: " + "; ".join(bad) + ". Remove the file and send again.")
        files = att.unique_names([a for a, _ in read])
        settings = settings_from_values(*values)
        msgs = session.chat["messages"] if session.chat is not None else []
        if session.editing and any(m["role"] == "user" for m in msgs):
            last = max(i for i, m in enumerate(msgs) if m["role"] == "user")
            files = files or att.message_files(msgs[last])
            del msgs[last:]
            session.chat["context_from"] = min(session.chat.get("context_from", 0), last)
        session.editing = False
        message = {"role": "user", "content": text}
        if files:  # fitted now, against the turns before it, and kept: later turns never change it
            message["attachments"] = [a.as_dict() for a in files]
            turns = turns_in_context(session.chat, system) + [message]
            try:
                plan = att.chat_prompt(turns, self.window(params_from(settings))).plans[len(turns) - 1]
            except (ConfigError, ValueError) as e:
                return self.view(session, status=f"Not sent: {e}")
            message["context"] = plan.as_dict()
        chat = self._ensure_chat(session, system, settings)
        chat["messages"].append(message)
        session.pending, session.error, session.too_long, session.auto_drop = True, None, False, False
        return self.view(session, textbox=EMPTY_BOX, files="", status="Waiting for the engine…")

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
        kept = " Its files stay unless you attach others." if users[-1].get("attachments") else ""
        return self.view(session, textbox={"text": users[-1]["content"], "files": []},
                         status="Editing your last message: change it and press Send to resend." + kept)

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
        answer = {"role": "assistant", "content": last.text, "stats": stats, "settings": summary(settings)}
        found = att.diffs(last.text, context_files(chat))
        if found:
            answer["diffs"] = [{"name": d.name, "diff": d.diff, "added": d.added, "removed": d.removed}
                               for d in found]
        chat["messages"].append(answer)
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
                        chats=self.chat_list(session), patched=self.patched_files(session))

    def _open(self, session: Session, chat: dict, settings: dict, cancel: threading.Event):
        """Start the engine stream and take its first event; with auto_drop, drop oldest turns on PromptTooLong."""
        params, dropped = params_from(settings), 0
        while True:
            stream = None
            try:
                stream = iter(self.engine.chat(prompt_messages(chat, self.window(params)), params, cancel=cancel))
                return stream, next(stream, None), dropped
            except PromptTooLong:
                if stream is not None and hasattr(stream, "close"):
                    stream.close()
                if session.auto_drop and drop_oldest_pair(chat):
                    dropped += 1
                    continue
                raise

    def patched_files(self, session: Session):
        """The download of the latest answer's patched files (written to the export folder); hidden without."""
        chat = session.chat
        last = chat["messages"][-1] if chat and chat["messages"] else None
        if last is None or last["role"] != "assistant" or not last.get("diffs"):
            return gr.update(value=None, visible=False)
        paths = []
        try:
            for d in att.diffs(last["content"], context_files(chat)):
                paths.append(str(self.store.export_patched(chat, d.name, d.patched)))
        except (OSError, HistoryError) as e:
            log.warning("patched files not written: %s", e)
        return gr.update(value=paths or None, visible=bool(paths))

    # -- history ---------------------------------------------------------------------------------
    def new_chat(self, session: Session, system: str, *values) -> tuple:
        """Start an empty chat with the current settings (stops this tab's running answer)."""
        session.cancel.set()
        session.chat = self.store.new_chat(system=system or "", settings=settings_from_values(*values))
        session.pending = session.editing = session.too_long = False
        session.error = None
        return self.view(session, textbox=EMPTY_BOX, status="New chat.", stats="", forest=forest_svg(None),
                         chats=self.chat_list(session), title="", files="", patched=self.patched_files(session))

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
        view = self.view(session, textbox=EMPTY_BOX, status=f"Opened “{title_of(chat)}”.",
                         stats=stats_markdown(last_stats), forest=forest_svg(None),
                         chats=self.chat_list(session, notices), system=chat["system"], title=chat.get("title", ""),
                         files="", patched=self.patched_files(session))
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
            text = gr.MultimodalTextbox(
                placeholder="Message (Enter to send, Shift+Enter for a new line) · attach files with 📎, by drag "
                            "and drop or paste", show_label=False, lines=2, max_lines=8, elem_id="message",
                autofocus=True, file_count="multiple", sources=["upload"], submit_btn=False)
            files = gr.Markdown("", elem_id="attach-info")
            with gr.Row():
                send_btn = gr.Button("Send", variant="primary", elem_id="send")
                stop_btn = gr.Button("Stop", variant="stop", elem_id="stop")
                regen_btn = gr.Button("Regenerate", elem_id="regenerate")
                edit_btn = gr.Button("Edit last", elem_id="edit")
                drop_btn = gr.Button("Drop oldest turns & retry", visible=False, elem_id="drop-oldest")
            patched = gr.File(label="Patched files (the latest answer's rewrite of your files)", visible=False,
                              interactive=False, file_count="multiple", elem_id="patched-files")
            stats = gr.Markdown(memory_line(), elem_id="stats", elem_classes=["dsbd-stats"])
            with gr.Accordion("Draft forest (latest DSBD iteration) · answer by origin", open=True):
                forest = gr.HTML(forest_svg(None), elem_id="forest")
        with gr.Column(scale=2, min_width=260, elem_id="settings-column"):
            system = gr.Textbox(label="System prompt", lines=3, placeholder="You are a helpful assistant.",
                                elem_id="system")
            panel = DecodingPanel()
    ui = ChatUI(engine, store, panel.updates)
    outputs = [chatbot, text, status, stats, forest, drop_btn, chats, system, title, patched, files]
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
    text.change(ui.preview, [session, text, system, *panel.components], [files], trigger_mode="always_last",
                **fast)
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
