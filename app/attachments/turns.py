"""A chat's turns with their files as the model sees them: `chat_prompt`, the one prompt builder of the chat tab,
the CLI (`generate --file`) and the API (content parts of type "file"); and a prompt-set item's user turn.

Each turn's files are fitted once, against the turns before it, when it is sent: a later question never changes
what the model saw of an earlier turn. The chat tab stores that plan with the turn; the CLI and the API, which
keep no chat, make it again from the same turns (the same numbers give the same plan).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from app.attachments.reading import Attachment
from app.attachments.rendering import render
from app.attachments.retrieval import Budget, ContextPlan, answer_reserve, estimate_tokens, fit


@dataclass(frozen=True)
class Window:
    """What fitting a turn's files needs: the model's context window in tokens, the tokens the answer needs beyond
    the prompt (`answer_reserve`), and how the model counts tokens."""

    n_ctx: int
    reserve: int
    measure: Callable[[list[dict]], int]  # chat messages -> tokens, as the model's chat template renders them
    count: Callable[[str], int] = estimate_tokens  # one text -> tokens

    @classmethod
    def of(cls, engine, params, *, encode: Callable[[list[dict]], list[int]] | None = None) -> "Window":
        """The window of a loaded engine for an answer with these DecodeParams; `encode` (messages -> token ids)
        when the prompt is not the engine's chat template (the CLI's --raw)."""
        encode = engine.encode if encode is None else encode
        return cls(n_ctx=engine.n_ctx, reserve=answer_reserve(params), measure=lambda messages: len(encode(messages)),
                   count=lambda text: len(engine.tokenizer.encode(text)))


@dataclass(frozen=True)
class ChatPrompt:
    """A chat as the model sees it. messages: {role, content}, each turn's files rendered before its text; plans:
    by message index, what went in of each turn's files; budgets: the context budget of each turn fitted now."""

    messages: list[dict]
    plans: dict[int, ContextPlan]
    budgets: dict[int, Budget]

    @property
    def last(self) -> int | None:
        """The index of the last turn with files (None when no turn has any)."""
        return max(self.plans, default=None)


def message_files(message: dict) -> list[Attachment]:
    """A chat message's attached files: Attachments or their stored dicts (none when it has none)."""
    return [a if isinstance(a, Attachment) else Attachment.from_dict(a) for a in message.get("attachments") or []]


def chat_prompt(messages: Sequence[dict], window: Window | None = None) -> ChatPrompt:
    """The prompt of a chat whose messages ({role, content}) may carry files (`attachments`). A turn's files go
    before its text as its plan says: the plan stored with it (`context`: what the chat tab sent), else the plan it
    gets against the turns before it in `window` (every file whole when they fit, else the passages its text
    needs: what it got when it was sent). Without a window, a turn with no stored plan gets its files whole."""
    out: list[dict] = []
    plans: dict[int, ContextPlan] = {}
    budgets: dict[int, Budget] = {}
    for i, m in enumerate(messages):
        files = message_files(m)
        plan = ContextPlan.from_dict(m.get("context")) if files else None
        if files and plan is None and window is not None:
            rest = window.measure(out + [{"role": m["role"], "content": m["content"]}])
            plan, budgets[i] = fit(m["content"], files, rest=rest, reserve=window.reserve, n_ctx=window.n_ctx,
                                   count=window.count)
        parts = None  # every file whole
        if plan is not None:
            plans[i], parts = plan, plan.parts
        out.append({"role": m["role"], "content": render(m["content"], files, parts)})
    return ChatPrompt(out, plans, budgets)


def task_prompt(item) -> str:
    """The user turn of a prompt-set item: a prompt string, or a task's prompt after its files ({name, text}),
    rendered as the chat sends attached files that fit."""
    if not isinstance(item, dict):
        return item
    return render(item["prompt"], task_files(item))


def task_files(item) -> list[Attachment]:
    """The files a prompt-set item attaches ({name, text} each; none for a prompt string)."""
    files = item.get("files") if isinstance(item, dict) else None
    return [Attachment(f["name"], f["text"], len(f["text"].encode())) for f in files or []]
