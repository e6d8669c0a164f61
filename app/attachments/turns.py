"""A chat's turns with their files: what the model sees of a stored message, and of a prompt-set item."""

from __future__ import annotations

from app.attachments.reading import Attachment
from app.attachments.rendering import render
from app.attachments.retrieval import ContextPlan

def message_files(message: dict) -> list[Attachment]:
    """A stored chat message's attached files (none when it has none)."""
    return [Attachment.from_dict(d) for d in message.get("attachments") or []]


def message_content(message: dict) -> str:
    """What the model sees of a stored message: its files (whole, or the parts its plan chose) and its text."""
    files = message_files(message)
    if not files:
        return message["content"]
    plan = ContextPlan.from_dict(message.get("context"))
    return render(message["content"], files, plan.parts if plan is not None else None)


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
