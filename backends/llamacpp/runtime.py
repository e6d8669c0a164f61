"""GGUF runtime on llama.cpp's low-level API: one unified KV cache per context, forests in one decode."""

from __future__ import annotations

import ctypes
import weakref
from pathlib import Path
from typing import Sequence

import numpy as np
import llama_cpp.llama_cpp as ll

from backends.base import (AcceptedPath, BackendError, Closing, ContextFull, Forest, Logits, ModelInfo, OutOfMemory,
                           PrefillReuse)
from backends.llamacpp import probe
from backends.llamacpp._native import ModelHandle, ThreadGovernor, check_gguf_header, default_threads, take_errors
from backends.llamacpp.layout import LayoutU
from backends.llamacpp.tokenizer import GGUFTokenizer
from offload.gguf_header import read_header
from offload.runtimes import KV_TYPE_BYTES, RUNTIMES

_LIMITS = RUNTIMES["llamacpp"]  # n_batch (tokens per llama_decode) and the sequence ids llama.cpp compiles in
_KV_TYPES = {"f32": 0, "f16": 1}  # ggml_type ids
# llama_get_logits returning the buffer's address as an int: a view of it is then made once per address and row
# count, not through a ctypes pointer and numpy's ctypes conversion at every pass.
_logits_address = ll._lib["llama_get_logits"]
_logits_address.argtypes, _logits_address.restype = [ll.llama_context_p_ctypes], ctypes.c_void_p
_DECODE_ERRORS = {1: "no free KV cell for the batch", 2: "aborted", -1: "invalid batch"}


class LlamaModel(Closing):
    """A loaded GGUF model: `info`, `tokenizer`, and `context(...)` factories."""

    def __init__(self, path: Path, *, n_threads: int | None = None, n_gpu_layers: int = 0,
                 kv_type: str = "f32", extra_bufts: str | None = None, rpc: Sequence[str] = ()) -> None:
        """extra_bufts: on | off | auto (None: $DSBD_CHAT_LLAMA_EXTRA_BUFTS, else auto = probe, see probe.py).

        rpc: HOST:PORT of llama.cpp RPC workers; n_gpu_layers then counts the layers on them (and on the local
        GPUs), -1 = all; the output head stays on the host CPU (backends.llamacpp.rpc).
        """
        if kv_type not in _KV_TYPES:
            raise ValueError(f"kv_type must be one of {sorted(_KV_TYPES)}, got {kv_type!r}")
        check_gguf_header(Path(path))
        placement = None
        if rpc:
            from backends.llamacpp.rpc import RPCDevices

            placement = RPCDevices(rpc)  # checks every worker before any native call can abort on one
            n_layer = read_header(Path(path), keep=()).n_layers or 0
            remote = n_layer if n_gpu_layers < 0 else min(n_gpu_layers, n_layer)
            placement.spread(remote)
            # llama.cpp counts the output layer as the first offloaded one; ours is pinned to the host CPU.
            n_gpu_layers = remote + 1
        self.repack = probe.decide(Path(path), extra_bufts)
        self._h = ModelHandle(Path(path), vocab_only=False, n_gpu_layers=n_gpu_layers,
                              extra_bufts=self.repack.extra_bufts, placement=placement)
        self.n_threads = n_threads or default_threads()
        # threads not pinned: fewer while other programs keep cores busy (one governor for every context)
        self.governor = ThreadGovernor(self.n_threads) if n_threads is None else None
        self.kv_type = kv_type
        self.tokenizer = GGUFTokenizer(self._h)
        self.info = _model_info(self._h, kv_type, self.repack)
        if placement is not None:
            from backends.llamacpp.rpc import summarize

            where = summarize(self._h.load_log, placement.devices, self.info.n_layers)
            self.info.extra.update(rpc=list(placement.endpoints), placement=where["layers"],
                                   buffers_mib=where["buffers_mib"])
        self._contexts: weakref.WeakSet[LlamaContext] = weakref.WeakSet()

    def context(self, *, rows: int, max_tokens: int, n_batch: int | None = None,
                max_seqs: int = _LIMITS.max_seqs, kv_type: str | None = None,
                flash_attn: bool = False) -> "LlamaContext":
        """A context for `rows` committed rows sharing `max_tokens` KV cells (prefixes stored once).

        n_batch bounds the tokens of one evaluate (default min(max_tokens, 512)); max_seqs bounds the
        sequence ids (rows + forest branch points), at most 256; kv_type defaults to the model's.
        flash_attn=True trades exactness for nothing measurable on CPU (see LlamaContext).
        """
        ctx = LlamaContext(self, rows=rows, max_tokens=max_tokens, n_batch=n_batch or min(max_tokens, _LIMITS.batch),
                           max_seqs=max_seqs, kv_type=kv_type or self.kv_type, flash_attn=flash_attn)
        self._contexts.add(ctx)
        return ctx

    def close(self) -> None:
        for ctx in list(self._contexts):  # a context must not outlive its model's weights
            ctx.close()
        self._h.close()


def _model_info(h: ModelHandle, kv_type: str, repack: probe.Verdict) -> ModelInfo:
    m = h.ptr
    hp = read_header(h.path, keep=()).hyperparameters()  # the K and V widths, which llama.cpp's API does not expose
    arch, head_k, head_v = hp.arch, hp.key_length, hp.value_length
    n_layer, n_head = ll.llama_model_n_layer(m), ll.llama_model_n_head(m)
    n_head_kv, n_embd = ll.llama_model_n_head_kv(m), ll.llama_model_n_embd(m)
    return ModelInfo(
        name=h.meta("general.name") or h.path.stem,
        backend="llamacpp",
        vocab_size=ll.llama_vocab_n_tokens(h.vocab),
        n_ctx_train=ll.llama_model_n_ctx_train(m),
        n_layers=n_layer,
        kv_bytes_per_token=n_layer * n_head_kv * (head_k + head_v) * KV_TYPE_BYTES[kv_type],  # K and V
        weight_bytes=h.path.stat().st_size,
        extra={"path": str(h.path), "arch": arch, "n_embd": n_embd, "n_head": n_head, "n_head_kv": n_head_kv,
               "head_dim": head_k, "kv_type": kv_type, "n_params": ll.llama_model_n_params(m),
               "weight_repack": repack.describe()},
    )


class _Memory:
    """llama_memory verbs for LayoutU."""

    def __init__(self, ctx) -> None:
        self._mem = ll.llama_get_memory(ctx)

    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        if not ll.llama_memory_seq_rm(self._mem, seq, p0, p1):
            raise BackendError(f"llama_memory_seq_rm({seq}, {p0}, {p1}) failed")

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        if p1 != 0:  # p1 = 0 is an empty range for us, but "to the end" for llama.cpp
            ll.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def clear(self) -> None:
        """Every cell freed and the search for free cells back at cell 0 (stale data stays: masked, finite)."""
        ll.llama_memory_clear(self._mem, False)


class LlamaContext(Closing):
    """KV state of one generation (the `backends.base.Context` protocol), Layout U of spec §7."""

    partial_outputs = True  # honours Forest.outputs: a node without an output adds no row to the batch's logits

    def __init__(self, model: LlamaModel, *, rows: int, max_tokens: int, n_batch: int, max_seqs: int,
                 kv_type: str = "f32", flash_attn: bool = False) -> None:
        if kv_type not in _KV_TYPES:
            raise ValueError(f"kv_type must be one of {sorted(_KV_TYPES)}, got {kv_type!r}")
        if rows < 1 or max_tokens < 1 or n_batch < 1:
            raise ValueError(f"rows, max_tokens and n_batch must be >= 1, got {rows}, {max_tokens}, {n_batch}")
        n_seq = min(max_seqs, _LIMITS.max_seqs)
        if rows > n_seq:
            raise ContextFull(f"{rows} rows need {rows} sequence ids; llama.cpp allows at most {n_seq}")
        self._model = model  # keeps the weights alive while this context exists
        self.max_tokens, self.n_batch = max_tokens, n_batch
        self._ctx = None
        self._batch = None
        p = ll.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch = max_tokens, n_batch, n_batch  # one ubatch: a failed decode rolls back
        p.n_seq_max = n_seq
        p.n_outputs_max = max(n_batch, n_seq)  # llama.cpp aborts (not errors) if n_seq_max exceeds it
        p.n_threads = p.n_threads_batch = model.n_threads
        p.kv_unified = True  # one cell pool; a cell may carry several sequence ids
        p.no_perf = True
        # Numerics: an f32 cache with plain attention makes logits independent of how tokens are batched;
        # only masked cells between visible ones shift SIMD summation lanes (last-bit changes, 1e-6 on f32
        # weights). Q4 weights re-quantize activations to 8 bits and can blow that up to ~1 logit (KL
        # ~1e-2). An f16 cache or flash attention (f16 sums in cell order) add more of the same.
        p.type_k = p.type_v = _KV_TYPES[kv_type]
        p.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        take_errors()
        ctx = ll.llama_init_from_model(model._h.ptr, p)
        if not ctx:
            why = take_errors()
            # A context fails to allocate, or fails for a reason llama.cpp logged; an empty log means allocation.
            cls = OutOfMemory if not why or _reports_oom(why) else BackendError
            raise cls(f"llama.cpp could not create a context of {max_tokens} tokens for "
                      f"{model.info.name}: {why or 'out of memory?'}")
        self._ctx = ctx
        self._threads = model.n_threads
        self._batch = ll.llama_batch_init(n_batch, 0, n_seq)
        self._mem = _Memory(ctx)
        self._vocab = model.info.vocab_size
        self._layout = LayoutU(n_seq=n_seq, max_rows=rows, n_vocab=self._vocab)
        self._reuse = PrefillReuse(n_batch)  # what a prompt keeps of the cache (the prompt chunks: n_batch)
        self._bytes_per_cell = model.info.kv_bytes_per_token * KV_TYPE_BYTES[kv_type] // KV_TYPE_BYTES[model.kv_type]
        # True: evaluate returns views of llama.cpp's output buffer, valid until this context's next decode
        # (set by a wrapper that copies what it keeps, backends.unique.UniquePaths); False: copies
        self.output_views = False
        self._views: dict[tuple[int, int], np.ndarray] = {}  # (buffer address, rows) -> a view of the buffer

    # -- protocol --------------------------------------------------------------------------------------
    @property
    def rows(self) -> int:
        return self._layout.rows

    def lengths(self) -> list[int]:
        return self._layout.lengths()

    def tokens(self, row: int) -> list[int]:
        """Committed token ids of one row (for tests and prefix reuse)."""
        return self._layout.tokens(row)

    def kv_bytes(self) -> int:
        return self._layout.cells * self._bytes_per_cell

    def prefill(self, ids: Sequence[int]) -> None:
        ids = list(ids)
        if len(ids) > self.max_tokens:
            raise ContextFull(f"prompt of {len(ids)} tokens exceeds the context's {self.max_tokens} tokens")
        self._live()
        seq, start = self._layout.start_prefill(ids, self._mem, lambda common: self._reuse.keep(common, len(ids)))
        if start == 0:
            self._mem.clear()  # the next chunk goes to cell 0, as in a fresh context
        self._reuse.written(start, start)
        for i in range(start, len(ids), self.n_batch):
            chunk = ids[i:i + self.n_batch]
            n = len(chunk)
            self._decode(chunk, list(range(i, i + n)), [[seq]] * n, [False] * (n - 1) + [True])
            self._layout.extend_prefill(chunk)
            self._reuse.written(i + n, start)

    def evaluate(self, forest: Forest) -> Logits:
        self._live()
        b = self._layout.plan(forest)
        n = len(b.tokens)
        if n == 0:
            empty = np.zeros((0, self._vocab), np.float32)
            return Logits((), empty, empty.copy())
        if n > self.n_batch:
            raise ContextFull(f"forest of {n} tokens exceeds the batch size {self.n_batch} (raise n_batch)")
        used = self._layout.cells
        if used + n > self.max_tokens:
            raise ContextFull(f"{used} KV cells in use + {n} new tokens exceed the context's {self.max_tokens}")
        self._layout.stage(b, self._mem)
        try:
            out = self._decode(b.tokens, b.pos, b.seqs, b.logits)  # [n_out, vocab]
        except BackendError:
            self._layout.unstage(b, self._mem)
            raise
        self._layout.apply(b)
        k = len(b.root_rows)
        return Logits(tuple(b.root_rows), out[:k], out[k:])

    def commit(self, paths: Sequence[AcceptedPath]) -> None:
        self._live()
        self._layout.commit(paths, self._mem)

    def truncate(self, n: int) -> None:
        self._live()
        self._layout.truncate(n, self._mem)
        self._reuse.truncated(n)

    def close(self) -> None:
        if self._batch is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            ll.llama_free(self._ctx)
            self._ctx = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    # -- native ----------------------------------------------------------------------------------------
    def _live(self) -> None:
        if self._ctx is None:
            raise BackendError("this llama.cpp context was closed")

    def _decode(self, tokens: list[int], pos: list[int], seqs: list[list[int]], logits: list[bool]) -> np.ndarray:
        """One llama_decode; returns the requested logits in batch order, [n_out, vocab] float32."""
        b = self._batch
        b.n_tokens = len(tokens)
        for i, (t, p, ss, lg) in enumerate(zip(tokens, pos, seqs, logits)):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, p, len(ss), lg
            sid = b.seq_id[i]
            for k, s in enumerate(ss):
                sid[k] = s
        gov = self._model.governor
        if gov is not None and gov.threads() != self._threads:
            self._threads = gov.current
            ll.llama_set_n_threads(self._ctx, self._threads, self._threads)
        take_errors()
        rc = ll.llama_decode(self._ctx, b)
        if rc != 0:
            why = _DECODE_ERRORS.get(rc, "fatal error")
            log = take_errors()
            cls = OutOfMemory if _reports_oom(log) else BackendError
            raise cls(f"llama_decode failed ({rc}: {why}) on {len(tokens)} tokens: {log}")
        rows = self._logits(sum(logits))  # [n_out, vocab]
        return rows if self.output_views else rows.copy()

    def _logits(self, n_out: int) -> np.ndarray:
        """The latest decode's n_out rows of logits, in place: a view of llama.cpp's output buffer, kept per buffer
        address (llama.cpp moves the buffer only when it grows it)."""
        address = _logits_address(self._ctx)
        view = self._views.get((address, n_out))
        if view is None:
            if not address:
                raise BackendError("llama.cpp returned no logits")
            if len(self._views) > 64 or any(a != address for a, _ in self._views):
                self._views.clear()
            cells = (ctypes.c_float * (n_out * self._vocab)).from_address(address)
            view = self._views[address, n_out] = np.ctypeslib.as_array(cells).reshape(n_out, self._vocab)
        return view


def _reports_oom(log: str) -> bool:
    """llama.cpp reports allocation failures only in its log: translate them here, at the boundary, into
    OutOfMemory so that nothing above reads message text."""
    return "out of memory" in log.lower()
