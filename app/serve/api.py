"""OpenAI-compatible HTTP API beside the chat UI: GET /v1/models, POST /v1/chat/completions, /v1/completions.

GET /v1/models lists the served model first (`loaded: true`; its id answers requests), then every model of
the local library (`backends.modelfiles.library`) as `library/<id>` with `loaded` telling whether it is the served
target or draft.

One FastAPI app serves both: the API routes under /v1 and the Gradio UI mounted at "/" (`build_server`).
API requests share the UI's engine, so its lock runs one generation at a time across both; each request
gets its own cancel Event, set when its client goes away (as the UI's Stop button does).
Decoding: `temperature == 0` means greedy, otherwise "sample"; the `dsbd` extension object picks any mode
and its settings ({"mode": "dsbd", "beams": 2, "gamma": 3, ...}); each choice carries its `dsbd_stats`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import math
import re
import secrets
import threading
import time
from dataclasses import replace
from typing import Annotated, Any, AsyncIterator, Callable, Literal

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, create_model
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from backends.base import BackendError

from app import attachments
from app.config import API_MODES, KNOBS, MODE_FACTS, ConfigError, DecodeParams
from app.decoding import derive_seed
from app.engine.interface import NoModelLoaded, PromptTooLong
from app.prompt import ChatError

log = logging.getLogger(__name__)
HOST = "127.0.0.1"  # loopback by default, like the UI
DEFAULT_MAX_TOKENS = DecodeParams.max_new_tokens  # the dataclass default, as the CLI and UI use
MAX_N = 16
_POLL_S = 0.25  # how often a request waiting for events checks whether its client went away


# -- request bodies (unknown OpenAI fields are ignored; unknown `dsbd` fields are errors) ----------------
# Each setting described as app.config.KNOBS states it (the docs at /v1/docs show it).
_OPTIONS = {"beams": int, "draft_beams": int, "gamma": int, "threshold": float, "min_beams": int, "select": str,
            "top_k": int, "length_penalty": float, "quality": str, "forest": str, "unique_paths": bool,
            "replacement": str, "lookup_nodes": int, "lookup_sources": list[str]}
DsbdOptions = create_model(
    "DsbdOptions", __config__=ConfigDict(extra="forbid"),
    __doc__="The `dsbd` extension: decoding mode and its settings (names as in DecodeParams).",
    mode=(str | None, Field(None, description=f"the decoding mode: {', '.join(MODE_FACTS)}")),
    **{name: (kind | None, Field(None, description=KNOBS[name].plain)) for name, kind in _OPTIONS.items()})


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict | None = None
    dsbd: DsbdOptions | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FileData(BaseModel):
    """OpenAI's file content part body: the file's bytes as base64 (a data: URL or bare) and its name."""

    model_config = ConfigDict(extra="ignore")
    file_data: str | None = None
    filename: str | None = None
    file_id: str | None = None


class FilePart(BaseModel):
    type: Literal["file"]
    file: FileData


class Message(BaseModel):
    role: str
    content: str | list[Annotated[TextPart | FilePart, Field(discriminator="type")]] | None = None


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = None  # the newer name of max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]


# -- errors in OpenAI's format ------------------------------------------------------------------------
class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.body = status, {"message": message, "type": type, "param": param, "code": code}

    def response(self) -> JSONResponse:
        # Retry-After: OpenAI clients retry a 503 on their own after that many seconds.
        headers = {401: {"WWW-Authenticate": self.challenge}, 503: {"Retry-After": "1"}}.get(self.status)
        return JSONResponse({"error": self.body}, status_code=self.status, headers=headers)

    challenge = "Bearer"  # 401's WWW-Authenticate; 'Bearer, Basic realm="dsbd-chat"' when a login is accepted


_DSBD_FIELDS = set(DsbdOptions.model_fields)


def _param_of(field: str | None) -> str | None:
    """The request parameter a DecodeParams field comes from (max_tokens, an OpenAI field, or dsbd.<name>)."""
    if field is None:
        return None
    return "max_tokens" if field == "max_new_tokens" else f"dsbd.{field}" if field in _DSBD_FIELDS else field


def as_api_error(e: BaseException, prompt_param: str) -> ApiError:
    """Engine / config exceptions -> the HTTP error a client should see."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, PromptTooLong):
        return ApiError(400, str(e), param=prompt_param, code="context_length_exceeded")
    if isinstance(e, ConfigError):
        return ApiError(400, str(e), param=_param_of(e.field))
    if isinstance(e, ChatError):
        return ApiError(400, str(e), param=prompt_param)
    if isinstance(e, NoModelLoaded):
        return ApiError(503, str(e), type="server_error", code="model_not_loaded")
    if isinstance(e, BackendError):
        return ApiError(500, str(e), type="server_error")
    log.error("API request failed", exc_info=e)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    err = exc.errors()[0]
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    if err.get("type") == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {err.get('msg')}").response()
    param = ".".join(loc) or None
    return ApiError(400, f"{param or 'body'}: {err.get('msg')}", param=param).response()


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return ApiError(exc.status_code, str(exc.detail), code=str(exc.status_code)).response()


# -- request -> DecodeParams ------------------------------------------------------------------------
def decode_params(req: _Sampling) -> DecodeParams:
    """OpenAI fields + the `dsbd` extension -> DecodeParams (validated later by the engine)."""
    d = req.dsbd or DsbdOptions()
    t = 1.0 if req.temperature is None else req.temperature  # OpenAI's default temperature is 1
    mode = d.mode or API_MODES["argmax" if t == 0 else "sampling"]
    facts = MODE_FACTS.get(mode)
    if t == 0 and facts is not None and not facts.samples:
        t = 1.0  # argmax modes ignore it, and DecodeParams wants T > 0
    max_tokens = getattr(req, "max_completion_tokens", None)
    max_tokens = req.max_tokens if max_tokens is None else max_tokens
    extra = d.model_dump(exclude_none=True, exclude={"mode"})
    if "lookup_sources" in extra:
        extra["lookup_sources"] = tuple(extra["lookup_sources"])
    return DecodeParams(mode=mode, max_new_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
                        temperature=t, top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed,
                        stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()), **extra)


def _messages(req: ChatRequest) -> list[dict]:
    """Request messages -> chat messages; a message's file parts become its `attachments` (read and checked
    here, with the part that failed named in the error)."""
    out = []
    for i, m in enumerate(req.messages):
        parts = [] if isinstance(m.content, str) else list(m.content or [])
        content = m.content if isinstance(m.content, str) else "".join(p.text for p in parts if p.type == "text")
        msg = {"role": "system" if m.role == "developer" else m.role, "content": content}
        files = [(j, p.file) for j, p in enumerate(parts) if p.type == "file"]
        if files:
            try:
                attachments.check_count(len(files))
            except attachments.AttachmentError as e:
                raise ApiError(400, str(e), param=f"messages.{i}.content", code="too_many_files") from None
            msg["attachments"] = attachments.unique_names([_file_part(f, f"messages.{i}.content.{j}.file")
                                                           for j, f in files])
        out.append(msg)
    return out


def _file_part(f: FileData, param: str) -> attachments.Attachment:
    name = f.filename or "attachment.txt"
    if f.file_data is None:
        raise ApiError(400, "files are taken inline only: send the file's bytes as base64 in file_data"
                       + (" (file_id needs the Files API, which this server does not have)" if f.file_id else ""),
                       param=f"{param}.file_data", code="file_data_required")
    data = f.file_data
    if data.startswith("data:"):
        head, sep, data = data.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ApiError(400, f"{name}: file_data must be base64 (data:<type>;base64,<data>)",
                           param=f"{param}.file_data", code="invalid_file_data")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{name}: file_data is not valid base64", param=f"{param}.file_data",
                       code="invalid_file_data") from None
    try:
        return attachments.from_bytes(name, raw)
    except attachments.AttachmentError as e:
        raise ApiError(400, str(e), param=param, code="invalid_file") from None


def _with_files(engine, messages: list[dict], params: DecodeParams) -> tuple[list[dict], dict | None]:
    """Messages as the model sees them, every turn's files rendered into it as the chat sends them (whole when
    they fit the context left before that turn, else the passages its text needs); plus what went in of the last
    turn with files (the response's dsbd_files)."""
    built = attachments.chat_prompt(messages, attachments.Window.of(engine, params))
    last = built.last
    if last is None:
        return built.messages, None
    files, plan, budget = messages[last]["attachments"], built.plans[last], built.budgets[last]
    info = {"message": last, "files": [{"name": a.name, "size": a.size, "kind": a.kind} for a in files],
            "retrieved": plan.retrieved, "tokens": plan.tokens, "budget": {
                "files": budget.files, "history": budget.history, "answer": budget.answer, "n_ctx": budget.n_ctx},
            "parts": None if plan.parts is None else [p.cite() for p in plan.parts]}
    return built.messages, info


def _prompts(engine, prompt) -> list[list[int]]:
    """A completion prompt (text, texts, token ids or lists of them) -> token id lists."""
    tok = engine.tokenizer
    items = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
    out = [tok.encode(p, add_bos=tok.add_bos) if isinstance(p, str) else list(p) for p in items]
    if not out or any(not ids or not all(0 <= t < tok.n_vocab for t in ids) for ids in out):
        raise ApiError(400, f"each prompt needs text or token ids in [0, {tok.n_vocab})", param="prompt")
    return out


def _finish_reason(stats: dict) -> str:
    return "length" if stats.get("finish_reason") == "length" else "stop"


def _clean(x: Any) -> Any:
    # Strict JSON has no inf/nan (a -inf log-prob would make JSONResponse fail).
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    return [_clean(v) for v in x] if isinstance(x, (list, tuple)) else x


# -- running generations ----------------------------------------------------------------------------
class _Gate:
    """Bounds API requests waiting for the engine (admitted, no output yet); one more gets 503 at once."""

    def __init__(self, limit: int) -> None:
        self.limit, self.waiting = limit, 0

    def admit(self) -> Callable[[], None]:
        if self.waiting >= self.limit:
            raise ApiError(503, f"the engine queue is full ({self.limit} API requests waiting); retry later",
                           type="server_error", code="queue_full")
        self.waiting += 1
        left = False

        def leave() -> None:  # idempotent; called on the event loop only
            nonlocal left
            if not left:
                left, self.waiting = True, self.waiting - 1

        return leave


class _Run:
    """One request's engine streams, iterated in order on a worker thread; events come back via a queue.

    A dedicated thread rather than Starlette's pool: a request may wait long for the engine lock, and the
    pool's threads also serve the Gradio UI. Only this thread touches the streams (a generator cannot be
    closed from another thread while it runs), so cancel is an Event and cleanup is in its `finally`.
    The gate slot is freed by the worker (first event, or its end), not by the request: a client that
    hangs up while queued still holds a thread blocked on the engine lock until its turn comes.
    """

    def __init__(self, streams: list, cancel: threading.Event, leave: Callable[[], None]) -> None:
        self.cancel, self.leave, self.finished = cancel, leave, False
        self.loop, self.queue = asyncio.get_running_loop(), asyncio.Queue()
        threading.Thread(target=self._work, args=(streams,), name="dsbd-api", daemon=True).start()

    def _call(self, fn, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the server shut down
            pass

    def _work(self, streams: list) -> None:
        try:
            for i, stream in enumerate(streams):
                if self.cancel.is_set():
                    break
                for ev in stream:
                    self._call(self.queue.put_nowait, (i, ev))
                    self._call(self.leave)
        except BaseException as e:  # noqa: BLE001 - re-raised on the event loop
            self._call(self.queue.put_nowait, (None, e))
        finally:
            for s in streams:
                s.close()  # releases the engine lock; unstarted streams never took it
            self._call(self.leave)
            self._call(self.queue.put_nowait, (None, None))

    async def events(self, request: Request) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, Event) until every stream is done; raises what the worker raised."""
        while True:
            try:
                i, item = await asyncio.wait_for(self.queue.get(), _POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise _ClientGone() from None
                continue
            if i is None:
                self.finished = True
                if item is not None:
                    raise item
                return
            if item.error:
                raise BackendError(item.error)
            yield i, item

    def close(self) -> None:
        """End of the request: stop the generation unless it finished (client gone, or a failure)."""
        if not self.finished:
            self.cancel.set()


class _ClientGone(Exception):
    pass


# -- the app --------------------------------------------------------------------------------------
def model_id(engine) -> str:
    """The served model's id: the target's name as a URL-safe slug ("dsbd-chat" while none is loaded)."""
    try:
        name = engine.describe()["target"]
    except NoModelLoaded:
        return "dsbd-chat"
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-") or "dsbd-chat"


def _basic(header: str) -> tuple[bytes, bytes] | None:
    """'Basic base64(user:pass)' -> (user, pass) as bytes; None if it is not that."""
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, sep, password = base64.b64decode(token.strip(), validate=True).partition(b":")
    except (binascii.Error, ValueError):
        return None
    return (user, password) if sep else None


def build_api(engine, *, api_key: str | None = None, auth: tuple[str, str] | None = None,
              max_waiting: int = 16) -> FastAPI:
    """The OpenAI-compatible API over `engine` under /v1. With `api_key` and/or `auth` (user, password) a
    request needs `Authorization: Bearer <key>` or HTTP basic auth with that login; with neither it is open."""
    gate = _Gate(max_waiting)  # the model id is read per request: the Models tab can swap models
    router = APIRouter(prefix="/v1", dependencies=[Depends(_credentials_check(api_key, auth))])
    _add_model_routes(router, engine)
    _add_completion_routes(router, engine, gate)

    @router.api_route("/{rest:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    def unknown(rest: str) -> None:  # registered last: it matches every path
        raise ApiError(404, f"unknown endpoint /v1/{rest}", code="not_found")

    app = FastAPI(title="dsbd-chat OpenAI-compatible API", docs_url="/v1/docs", openapi_url="/v1/openapi.json",
                  redoc_url=None)
    app.add_exception_handler(ApiError, lambda _, e: e.response())
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.include_router(router)
    app.state.gate = gate  # tests and monitoring: gate.waiting
    return app


def _credentials_check(api_key: str | None, auth: tuple[str, str] | None):
    """The dependency every /v1 request passes: the bearer key or the basic-auth login, when either is set."""

    def check_key(request: Request) -> None:
        if api_key is None and auth is None:
            return
        got = request.headers.get("authorization", "")
        # compare_digest on both parts every time: no early exit that would time which part was wrong.
        key_ok = api_key is not None and secrets.compare_digest(got.encode(), f"Bearer {api_key}".encode())
        login_ok = False
        if auth is not None:
            user, password = _basic(got) or (b"", b"")
            login_ok = secrets.compare_digest(user, auth[0].encode()) & \
                secrets.compare_digest(password, auth[1].encode())
        if key_ok or login_ok:
            return
        want = " or ".join(x for x in ("'Authorization: Bearer <key>'" if api_key is not None else "",
                                       "HTTP basic auth with the --auth login" if auth is not None else "") if x)
        err = ApiError(401, f"missing or wrong credentials: send {want}",
                       code="invalid_api_key" if api_key is not None else "invalid_login")
        if auth is not None:
            err.challenge = 'Bearer, Basic realm="dsbd-chat"' if api_key is not None else 'Basic realm="dsbd-chat"'
        raise err

    return check_key


def _add_model_routes(router: APIRouter, engine) -> None:
    @router.get("/models")
    def list_models() -> dict:
        served = [] if _unloaded(engine) else [_model_card(engine)]
        return {"object": "list", "data": [*served, *_library_cards(engine)]}

    @router.get("/models/{model:path}")
    def get_model(model: str) -> dict:
        name = model_id(engine)
        if model == name:
            return _model_card(engine)
        card = next((c for c in _library_cards(engine) if c["id"] == model), None)
        if card is None:
            raise ApiError(404, f"model {model!r} is not served here; this server has {name!r}",
                           param="model", code="model_not_found")
        return card


def _add_completion_routes(router: APIRouter, engine, gate: _Gate) -> None:
    @router.post("/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request) -> Response:
        messages, extra = _messages(req), {}

        def open_streams(p, cancel):
            sent, info = _with_files(engine, messages, p)
            if info is not None:
                extra["dsbd_files"] = info
            return [engine.chat(sent, replace(p, seed=derive_seed(p.seed, j)) if req.n > 1 else p, cancel=cancel)
                    for j in range(req.n)]

        return await _serve(engine, gate, request, req, "chat", "messages", open_streams, extra)

    @router.post("/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        def open_streams(p, cancel):
            return [engine.generate(ids, replace(p, seed=derive_seed(p.seed, j)) if req.n > 1 else p, cancel=cancel)
                    for ids in _prompts(engine, req.prompt) for j in range(req.n)]

        return await _serve(engine, gate, request, req, "text", "prompt", open_streams)


async def _serve(engine, gate: _Gate, request: Request, req: _Sampling, kind: str, prompt_param: str,
                 open_streams, extra: dict | None = None) -> Response:
    """Admit one completion request, open its streams off the event loop, and answer it (streamed or whole)."""
    try:
        params = engine.check_params(decode_params(req))
        leave = gate.admit()
    except Exception as e:
        return as_api_error(e, prompt_param).response()
    cancel = threading.Event()
    try:  # encoding the prompt is real work: keep it off the event loop
        streams = await run_in_threadpool(open_streams, params, cancel)
    except Exception as e:
        leave()
        return as_api_error(e, prompt_param).response()
    run = _Run(streams, cancel, leave)
    head = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{secrets.token_hex(12)}",
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model_id(engine)} | (extra or {})
    if req.stream:
        usage = bool((req.stream_options or {}).get("include_usage"))
        return StreamingResponse(_sse(run, request, kind, head, prompt_param, usage, req.n),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _complete(run, request, kind, head, prompt_param, req.n)


def _unloaded(engine) -> bool:
    """No model is loaded (the Models tab unloaded them): only the library is listed."""
    try:
        engine.describe()
    except NoModelLoaded:
        return True
    return False


def _model_card(engine) -> dict:
    return {"id": model_id(engine), "object": "model", "created": 0, "owned_by": "dsbd-chat", "loaded": True,
            "dsbd": engine.describe()}


LIBRARY_PREFIX = "library/"


def _library_cards(engine) -> list[dict]:
    """The model library as OpenAI model objects (`library/<id>`), each with `loaded`: whether it is the served
    target or draft. Requests still answer with the loaded pair; the Models tab switches models."""
    from backends.modelfiles import library

    try:
        entries = library.scan().entries
    except Exception as e:  # noqa: BLE001 (the library is extra information: the served model stays listed)
        log.warning("model library not listed: %s", e)
        return []
    specs = getattr(engine, "specs", None) or (None, None)
    loaded = {}
    for spec, role in zip(specs, ("target", "draft")):
        if spec is not None and (hit := library.match_source(spec.source, role, entries)) is not None:
            loaded.setdefault(hit.id, role)
    return [{"id": LIBRARY_PREFIX + e.id, "object": "model", "created": int(e.mtime), "owned_by": "local",
             "loaded": e.id in loaded, "dsbd": {k: v for k, v in e.as_dict().items() if k in _PUBLIC} |
             ({"loaded_as": loaded[e.id]} if e.id in loaded else {})}
            for e in entries]


# What an API client learns about a library model: no file paths or folder names of this machine.
_PUBLIC = ("name", "source", "size", "complete", "problem", "kind", "arch", "params", "params_label", "quant",
           "context_length", "n_layers", "chat_template", "family", "repo", "preset")


def _usage(done: dict[int, Any], per_prompt: int) -> dict:
    # Each prompt counts once, however many choices it has (as OpenAI does).
    prompt = sum(ev.stats.get("prompt_tokens", 0) for i, ev in done.items() if i % per_prompt == 0)
    completion = sum(ev.tokens for ev in done.values())
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _choice(kind: str, i: int, text: str, ev=None, *, role: bool = False, stream: bool = False) -> dict:
    """One choice: whole (non-stream) or a chunk's delta; the final one carries finish_reason and stats."""
    c: dict = {"index": i}
    if kind == "chat":
        body = {"role": "assistant", "content": text} if role or not stream else {"content": text} if text else {}
        c["delta" if stream else "message"] = body
    else:
        c["text"] = text
    c |= {"logprobs": None, "finish_reason": None}
    if ev is not None and ev.done:
        stats = ev.stats or {}
        c |= {"finish_reason": _finish_reason(stats), "dsbd_stats": _clean(stats)}
    return c


async def _complete(run: _Run, request: Request, kind: str, head: dict, prompt_param: str, n: int) -> Response:
    done: dict[int, Any] = {}
    try:
        async for i, ev in run.events(request):
            if ev.done:
                done[i] = ev
    except _ClientGone:
        log.info("%s: client went away; generation cancelled", head["id"])
        return Response(status_code=499)
    except Exception as e:
        return as_api_error(e, prompt_param).response()
    finally:
        run.close()
    choices = [_choice(kind, i, ev.text, ev) for i, ev in sorted(done.items())]
    return JSONResponse(head | {"choices": choices, "usage": _usage(done, n)})


async def _sse(run: _Run, request: Request, kind: str, head: dict, prompt_param: str,
               usage: bool, n: int) -> AsyncIterator[str]:
    """Server-sent events: per choice a role chunk, text deltas, a final chunk; then [DONE]."""
    chunk = head | {"object": "chat.completion.chunk" if kind == "chat" else "text_completion"}
    sent: dict[int, str] = {}
    done: dict[int, Any] = {}
    try:
        async for i, ev in run.events(request):
            if i not in sent:
                sent[i] = ""
                if kind == "chat":
                    yield _data(chunk | {"choices": [_choice(kind, i, "", role=True, stream=True)]})
            # The stable text only grows; anything else (never expected) is not re-sent.
            delta = ev.text[len(sent[i]):] if ev.text.startswith(sent[i]) else ""
            sent[i] += delta
            if delta or ev.done:
                yield _data(chunk | {"choices": [_choice(kind, i, delta, ev, stream=True)]})
            if ev.done:
                done[i] = ev
        if usage:
            yield _data(chunk | {"choices": [], "usage": _usage(done, n)})
        yield "data: [DONE]\n\n"
    except _ClientGone:
        log.info("%s: client went away; generation cancelled", head["id"])
    except Exception as e:  # headers are out: report in-band, as OpenAI does
        yield _data({"error": as_api_error(e, prompt_param).body})
    finally:
        run.close()  # also on CancelledError, which Starlette raises here when the client disconnects


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, allow_nan=False)}\n\n"


def build_server(engine, *, api_key: str | None = None, auth: tuple[str, str] | None = None, max_waiting: int = 16,
                 data_dir=None, host: str = HOST, port: int = 7860) -> FastAPI:
    """The API at /v1 with the Gradio chat UI (queued with QUEUE_KWARGS) mounted at "/".
    `auth` (user, password): the UI asks for that login, and the API accepts it as HTTP basic auth."""
    import gradio as gr

    from app.serve.ui import QUEUE_KWARGS, build_app, launch_kwargs

    app = build_api(engine, api_key=api_key, auth=auth, max_waiting=max_waiting)
    blocks = build_app(engine, data_dir=data_dir)
    blocks.queue(**QUEUE_KWARGS)
    # Gradio 6 takes css / theme / allowed_paths / auth at mount time, as it does at launch.
    return gr.mount_gradio_app(app, blocks, path="/", server_name=host, server_port=port, auth=auth,
                               **launch_kwargs(blocks))


def serve(engine, *, host: str = HOST, port: int = 7860, api_key: str | None = None,
          auth: tuple[str, str] | None = None, inbrowser: bool = True, data_dir=None) -> None:
    """Run the UI and the API on one uvicorn server until Ctrl+C."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(build_server(engine, api_key=api_key, auth=auth, data_dir=data_dir,
                                                       host=host, port=port),
                                           host=host, port=port, log_level="warning"))
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}/"
    print(f"dsbd-chat: chat UI at {url} · OpenAI-compatible API at {url}v1", flush=True)
    if inbrowser:
        threading.Thread(target=_open_when_up, args=(server, url), daemon=True).start()
    server.run()


def _open_when_up(server, url: str) -> None:
    import webbrowser

    while not server.started and not server.should_exit:
        time.sleep(0.1)
    if server.started:
        webbrowser.open(url)


__all__ = ["build_api", "build_server", "serve", "decode_params", "model_id", "ApiError", "DEFAULT_MAX_TOKENS"]
