"""Chat messages -> token ids through the model's chat template, rendered in a sandboxed Jinja environment.

User text is never parsed into special tokens: contents are swapped for sentinels before rendering,
the template's own text is tokenized with special tokens enabled, and each content piece without.
"""

from __future__ import annotations

import secrets
from functools import lru_cache

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Used when a model file carries no template (ChatML, what SmolLM2 and Qwen2.5 use).
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ROLES = ("system", "user", "assistant")


class ChatError(ValueError):
    """Messages or template cannot be turned into a prompt; the message says why."""


def _raise(message: str):
    raise TemplateError(message)


@lru_cache(maxsize=8)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise
    return env.from_string(template)


def render_chat(messages: list[dict], template: str | None, *, bos: str = "", eos: str = "") -> tuple[str, dict]:
    """Render with contents replaced by sentinels; returns (text, {sentinel: content})."""
    for m in messages:
        if m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise ChatError(f"each message needs a role in {ROLES} and text content, got {m!r:.80}")
    pieces, safe = {}, []
    for m in messages:
        tag = f"\x00{secrets.token_hex(8)}\x00"
        pieces[tag] = m["content"]
        safe.append({"role": m["role"], "content": tag})
    try:
        text = _compile(template or CHATML).render(messages=safe, add_generation_prompt=True,
                                                   bos_token=bos, eos_token=eos)
    except Exception as e:  # SecurityError is a TemplateError; the sandbox also raises OverflowError & co.
        raise ChatError(f"the model's chat template failed: {e}") from e
    return text, pieces


def encode_chat(messages: list[dict], tokenizer) -> list[int]:
    """Token ids of the chat prompt, ending with the assistant turn's opening."""
    # piece(): decode() hides control tokens, but a template needs their text (e.g. "<|im_end|>").
    bos = tokenizer.piece(tokenizer.bos_id).decode("utf-8", "ignore") if tokenizer.bos_id is not None else ""
    eos_id = getattr(tokenizer, "eos_id", None)
    eos = tokenizer.piece(eos_id).decode("utf-8", "ignore") if eos_id is not None else ""
    text, pieces = render_chat(messages, tokenizer.chat_template, bos=bos, eos=eos)
    ids: list[int] = []
    if tokenizer.add_bos and tokenizer.bos_id is not None and not text.startswith(bos or "\x01"):
        ids.append(tokenizer.bos_id)
    rest = text
    while rest:
        cut = min(((rest.find(t), t) for t in pieces if t in rest), default=None)
        if cut is None:
            ids += tokenizer.encode(rest, special=True)
            break
        at, tag = cut
        if at:
            ids += tokenizer.encode(rest[:at], special=True)
        ids += tokenizer.encode(pieces[tag], special=False)
        rest = rest[at + len(tag):]
    return ids
