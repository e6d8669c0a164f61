"""The engine: owns the loaded models and their KV contexts, runs one generation at a time, streams events.

Decoders yield token-level `Step`s; the engine turns them into text events, enforces the context
limit (never truncating silently), and honours a per-request cancel event.
"""

from __future__ import annotations

import functools
import gc
import logging
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator, Sequence

from backends.base import BackendError, ContextFull, OutOfMemory
from backends.unique import CountingContext, UniquePaths
from offload.runtimes import RUNTIMES

from app.config import MAX_BEAMS, MODE_FACTS, ConfigError, DecodeParams
from backends.registry import ModelSpec
from app.decoding import derive_seed, rowmath, start
from app.decoding.beams import Stopper
from app.decoding.lookups import CorpusIndex
from app.decoding.metrics import Metrics
from app.engine.interface import Event, ModelEngine, NoModelLoaded, PromptTooLong
from app.engine.learned import Learned, entry_key, model_key
from app.engine.planning import tree_tokens
from app.engine.timing import CAL_POINTS, TIMED, PassCosts, cached_costs, cost_profile
from app.prompt import ChatError, encode_chat
from backends.load_progress import LoadTracker, tracking

log = logging.getLogger(__name__)


class Engine(ModelEngine):
    """Loaded target (+ draft) and their contexts in this process; thread-safe, one generation at a time."""

    specs: tuple[ModelSpec | None, ModelSpec | None] = (None, None)  # (target, draft) as loaded; for the UI
    plan = None  # offload.plan.Plan the models were loaded with (None: not planned)

    def __init__(self, target, draft=None, *, n_ctx: int = 4096) -> None:
        self.target, self.draft = target, draft
        self.n_ctx = min(n_ctx, target.info.n_ctx_train or n_ctx)
        self.tokenizer = target.tokenizer
        self._ctx: dict[str, tuple[int, object, int]] = {}  # role -> (rows, context, KV cells)
        self.lock = threading.Lock()
        self._warm_lock = threading.Lock()  # one pass-cost timing at a time
        # held while background work runs native code on the models (prepare() making a context, a pass being
        # timed): close() waits for it, so no native call outlives the weights
        self._native = threading.Lock()
        self._closed = False
        self._warming = threading.Event()  # set while a thread times the passes (answers then do not wait)
        self.policy = None  # app.engine.auto.AutoPolicy: timed on the first auto request, dropped on a model swap
        self._finished: deque = deque(maxlen=64)  # (params, stats) of recent answers, taught to a new policy
        self.cost_profile = cost_profile(TIMED)  # what adaptive forests and auto price passes with
        # What adaptive forests learnt, by learned.entry_key: forest_policy.Acceptance per model pair, profile and
        # setting; lookups.Calibration per target. Read from and written to the cache folder (app/engine/learned.py).
        self.learned = Learned()
        self._acceptance: dict = {}
        self._calibration: dict = {}
        self._unsaved: set[str] = set()  # keys of models without a file identity: learnt in memory only
        # Earlier chats' tokens (prompt + answer, the newest version of each chat) for the match source's
        # lookup nodes: in memory, bounded (lookups.CORPUS_TOKENS), dropped with the target's tokenizer; the saved
        # chats (remember_chats) fill it at the first generation, and again after the target changes.
        self.corpus = CorpusIndex()
        self._saved: list[list[dict]] = []  # saved chats' messages (newest first), for the corpus at startup
        self._saved_due = False  # they still have to be encoded into the corpus (at the next generation)
        if draft is not None:
            from backends.tokenizer import check_compatible

            check_compatible(draft.tokenizer, target.tokenizer)

    @classmethod
    def load(cls, target: ModelSpec, draft: ModelSpec | None = None, *, budget=None, profile: str = TIMED,
             progress=None, cancel: threading.Event | None = None) -> "Engine":
        """Plan memory (offload.plan), then load both models as planned. A plan that cannot fit raises
        PlanError, saying what would, before any weights are read. `progress(LoadStep)` hears each stage;
        setting `cancel` stops the load (LoadCancelled). `profile`: the cost profile adaptive
        forests are priced with (app.engine.timing)."""
        with tracking(LoadTracker(progress, cancel)) as tracker:
            target = target.validated()
            draft = draft.validated() if draft is not None else None
            plan = _plan(target, draft, tracker, budget=budget)
            loaded = []
            try:
                for role, spec in (("target", target), ("draft", draft)):
                    if spec is not None:
                        loaded.append(_load_role(spec, role, plan, tracker))
                tracker.role = None
                tracker.report("check", 0.0)
                engine = cls(*loaded, n_ctx=target.n_ctx)
                tracker.tell("check", 1.0)
            except BaseException:
                for m in reversed(loaded):
                    m.close()
                raise
        engine.specs, engine.plan = (target, draft), plan
        if profile != TIMED:
            engine.use_cost_profile(profile)
        rowmath.prewarm()  # the decoders' torch imports in the background, while a user types the first message
        settle_heap()
        return engine

    def swap(self, target: ModelSpec, draft: ModelSpec | None = None, *, progress=None,
             cancel: threading.Event | None = None) -> dict:
        """Replace the models; returns describe(). On any failure the old models stay loaded and serving.

        New models load beside the old ones, outside the lock, so answers keep streaming meanwhile; a spec
        equal to the one already serving that role is kept, not reloaded. Only the switch itself waits
        for the running generation. `progress(LoadStep)` hears each stage (backends.load_progress); setting
        `cancel` stops the load at its next report (llama.cpp: within its load) and raises LoadCancelled.
        """
        tracker = LoadTracker(progress, cancel)
        with tracking(tracker):
            target = target.validated()
            draft = draft.validated() if draft is not None else None
            fresh = []  # loaded by this call: closed again if anything fails
            try:
                plan = _plan(target, draft, tracker, keep=lambda role, spec: self._serving(role, spec) is not None)
                models = []
                for role, spec in (("target", target), ("draft", draft)):
                    m = self._serving(role, spec)
                    if m is None and spec is not None:
                        m = _load_role(spec, role, plan, tracker)
                        fresh.append(m)
                    models.append(m)
                tracker.role = None
                tracker.report("check", 0.0)
                staged = type(self)(*models, n_ctx=target.n_ctx)  # the same checks and n_ctx as at startup
                tracker.tell("check", 1.0)
                tracker.report("switch", 0.0)
                while not self.lock.acquire(timeout=_POLL_S):  # waits for the running answer; cancel still works
                    tracker.check()
            except BaseException:
                for m in fresh:
                    m.close()
                raise
        keep = {id(m) for m in models}
        try:
            stale = [ctx for _, ctx, _ in self._ctx.values()]
            old = {id(m): m for m in (self.target, self.draft) if m is not None and id(m) not in keep}
            # The new state first, so a failing close below cannot leave the engine half switched.
            self._ctx.clear()
            if staged.target is not self.target:  # token ids mean nothing to another tokenizer
                self.corpus, self._saved_due = CorpusIndex(), bool(self._saved)
            self.target, self.draft, self._closed = staged.target, staged.draft, False
            self.n_ctx, self.tokenizer, self.specs = staged.n_ctx, staged.tokenizer, (target, draft)
            self.plan, self.policy = plan, None  # pass costs and acceptance belong to the old models
            self._finished.clear()
            for ctx in stale:
                ctx.close()
            for m in old.values():
                m.close()
        finally:
            self.lock.release()
        settle_heap()  # the old models' objects can go now
        tracker.tell("switch", 1.0)
        return self.describe()

    def _unload_all(self) -> None:
        with self.lock:
            self.close()
            self.target = self.draft = self.tokenizer = None
            self.specs, self.plan, self.policy = (None, None), None, None
            self._finished.clear()

    def _require(self) -> None:
        if self.target is None:
            raise NoModelLoaded()

    def _serving(self, role: str, spec: ModelSpec | None):
        """The model now serving `role` if it was loaded from `spec` (None: load it, or no such role)."""
        i = 0 if role == "target" else 1
        return (self.target, self.draft)[i] if spec is not None and self.specs[i] == spec else None

    def close(self) -> None:
        self._closed = True  # prepare() makes nothing more, and the pass timing stops
        with self._native:  # a context being made or a pass being timed finishes before the weights go
            pass
        for _, ctx, _ in self._ctx.values():
            ctx.close()
        self._ctx.clear()
        for m in {id(self.target): self.target, id(self.draft): self.draft}.values():
            if m is not None:
                m.close()

    def describe(self) -> dict:
        self._require()
        d = {"target": self.target.info.name, "target_backend": self.target.info.backend, "n_ctx": self.n_ctx}
        if self.draft is not None:
            d |= {"draft": self.draft.info.name, "draft_backend": self.draft.info.backend}
        d["machine"] = self.machine_class()
        d["row_math"] = rowmath.backend().name
        if self.cost_profile.name != TIMED:
            d["cost_profile"] = self.cost_profile.name
        repack = {m.info.extra.get("weight_repack") for m in (self.target, self.draft) if m is not None} - {None}
        if repack:  # llama.cpp: whether the weight repack runs (off where it crashes, e.g. AMX)
            from backends.host import cpu_summary

            d["cpu"] = f"{cpu_summary()}; " + "; ".join(sorted(repack))
        if where := self.target.info.extra.get("placement"):  # an RPC target: which machine holds what
            d["target_placement"] = where
            if self.draft is not None:
                d["draft_placement"] = "this machine"
        return d

    # -- contexts ------------------------------------------------------------------------------
    def _context(self, role: str, rows: int, cells: int):
        """A context with >= rows rows; a unified cache (llama.cpp's) also needs >= cells KV cells in all."""
        model = self.target if role == "target" else self.draft
        facts = RUNTIMES.get(model.info.backend)  # None: a model outside the runtime table (a reference model)
        unified = facts is not None and facts.unified_kv
        size = max(self.n_ctx, -(-cells // 512) * 512) if unified else self.n_ctx
        have = self._ctx.get(role)
        if have is not None and have[0] >= rows and have[2] >= size:
            return have[1]
        if have is not None:
            have[1].close()
        ctx = model.context(rows=rows, max_tokens=size)
        if hasattr(ctx, "device_rows"):  # a runtime that can keep its rows where it computed them (PyTorch)
            ctx.device_rows = rowmath.backend().reads(ctx.device)  # only token ids and scalars reach the host
        self._ctx[role] = (rows, ctx, size)
        return ctx

    # -- generation ----------------------------------------------------------------------------
    # The public calls validate the request once; the private ones take validated DecodeParams.
    def check_params(self, params: DecodeParams) -> DecodeParams:
        """Validated params as they would run; auto stays auto (it picks when its generation starts)."""
        self._require()
        params = params.validated()
        return params if params.mode == "auto" else self._resolve(params)[0]

    def resolve(self, params: DecodeParams) -> tuple[DecodeParams, str | None]:
        """Validated params, switched to memory-reduced DSBD when full mode does not fit the memory plan."""
        self._require()
        return self._resolve(params.validated())

    def _resolve(self, params: DecodeParams) -> tuple[DecodeParams, str | None]:
        if params.mode == "auto":
            raise ConfigError("auto picks a concrete mode first: call Engine.pick")
        if params.needs_draft and self.draft is None:
            alone = " / ".join(m for m, f in MODE_FACTS.items() if f.concrete and not f.needs_draft)
            raise ConfigError(f"mode {params.mode!r} needs a draft model: load one (--draft) or pick {alone}",
                              field="mode")
        plan = self.plan
        twin = MODE_FACTS[params.mode].memory_twin
        if twin and plan is not None and plan.dsbd_full_fits is not None and params.beams > plan.max_beams:
            notice = (f"{params.mode} with {params.beams} beams needs more KV memory than the plan allows (at most "
                      f"{plan.max_beams} beams in full mode at a {plan.context}-token context): running {twin}, "
                      "which carries one beam between iterations")
            return replace(params, mode=twin), notice
        self._forest_budget(params)
        return params, None

    def _forest_budget(self, params: DecodeParams) -> int | None:
        """gamma x W_S an adaptive forest may draft within the runtimes' sequence ids, None without a bound. A
        context gives each row an id and may need one more per forest node (a branch), so a forest fits when
        rows + nodes <= the bound; the lookup nodes (up to lookup_nodes a layer) are reserved first. A fixed
        forest, or lookup nodes alone, that may not fit are a ConfigError before anything runs."""
        facts = MODE_FACTS[params.mode]
        bounded = [RUNTIMES[m.info.backend] for m in (self.target, self.draft)
                   if m is not None and m.info.backend in RUNTIMES and RUNTIMES[m.info.backend].max_seqs]
        if not bounded or not facts.forest:
            return None
        runtime = min(bounded, key=lambda rt: rt.max_seqs)
        bound = runtime.max_seqs
        rows, lookups = facts.rows(params.beams), params.lookup_nodes * params.gamma
        ws = params.draft_beams if self.draft is not None and params.uses_draft else 0
        need = rows + lookups + ws * params.gamma
        if need <= bound:
            return None
        if params.adaptive and rows + lookups < bound:
            return bound - rows - lookups
        raise ConfigError(f"this forest ({params.gamma} layers of {ws} drafts and {params.lookup_nodes} lookup nodes "
                          f"over {rows} rows) may need {need} sequence ids in one pass; {runtime.label} holds {bound}: "
                          "lower draft_beams, gamma or lookup_nodes"
                          + ("" if params.adaptive or rows + lookups >= bound else ", or use the adaptive forest"),
                          field="draft_beams" if ws * params.gamma > lookups else "lookup_nodes")

    def pick(self, params: DecodeParams) -> tuple[DecodeParams, dict]:
        """Auto mode: the setting of params.quality with the best projected tok/s, and what it was based on.
        The first call after a load times the models' passes (seconds; waits for a running answer)."""
        self._require()
        return self._pick(params.validated())

    def _pick(self, params: DecodeParams) -> tuple[DecodeParams, dict]:
        from app.engine.auto import describe

        info = {"quality": params.quality}
        if self.policy is None and self._warming.is_set():
            # The passes are being timed in the background: the quality's simplest candidate, not a wait.
            from app.engine.auto import AutoPolicy

            chosen = AutoPolicy.simplest(params, params.quality, drafted=self.draft is not None)
            return chosen, info | {"setting": describe(chosen), "pricing": "the pass costs are still being timed"}
        info |= self._calibrated()
        with self.lock:
            chosen = self.policy.choose(params, params.quality)
            info |= {"setting": describe(chosen), "projected_tokens_per_s": self.policy.projected_tps(chosen)}
        return chosen, info

    def _calibrated(self) -> dict:
        """Time the passes once per model load (AutoPolicy), each point under the lock so answers run between
        them; {"calibration_s": s} if it did now. Models swapped meanwhile are timed afresh."""
        from app.engine.auto import AutoPolicy

        if self.policy is not None:
            return {}
        with self._warm_lock:  # one timing at a time; a second caller finds the policy made
            t0 = time.perf_counter()
            if self.policy is not None:
                return {}
            while self.policy is None:
                with self.lock:
                    self._require()
                    models = (self.target, self.draft)
                    prof = self._placed(self.cost_profile) if self.cost_profile.datasheet is not None \
                        else self.cost_profile
                    if prof.target is not None:
                        self._adopt(AutoPolicy(prof.target, prof.draft if self.draft is not None else None))
                        break
                self._warming.set()
                try:
                    timed = [cached_costs(m, CAL_POINTS, hold=functools.partial(self._holding, models))
                             if m is not None else None for m in models]
                except _ModelsChanged:
                    continue
                finally:
                    self._warming.clear()
                with self.lock:
                    if (self.target, self.draft) == models:
                        self._adopt(self._answered(models, timed))
            if self.policy is None:
                return {}
        took = round(time.perf_counter() - t0, 2)
        log.info("pass costs ready in %.1f s (auto mode, adaptive forests; timed, or read from the timing cache)", took)
        return {"calibration_s": took}

    def _answered(self, models, timed):
        """Auto's policy on the timed pass costs, corrected by what earlier answers' passes taught (here and
        in earlier processes) and learning from every answer from now on (app.engine.timing.PassCosts)."""
        from app.engine.auto import AutoPolicy

        learners = []
        for m, t in zip(models, timed):
            key = self._learn_key("passes", (m,)) if t else None
            learners.append(PassCosts(t, self.learned.passes(key), setting=key) if key else None)
        target, draft = learners
        return AutoPolicy(target.curve(), draft.curve() if draft else None, passes=(target, draft))

    def _adopt(self, policy) -> None:
        """Under the lock: auto mode and adaptive forests price with `policy` from now on."""
        for seen in self._finished:  # answers given before auto was first asked for
            policy.observe(*seen)
        self.policy = policy

    @contextmanager
    def _holding(self, models):
        """The lock, for timing one point of `models`' passes; _ModelsChanged once they were swapped out,
        NoModelLoaded once the engine was closed."""
        with self.lock, self._native:
            if self._closed:
                raise NoModelLoaded("the models were closed while their passes were being timed")
            if (self.target, self.draft) != models:
                raise _ModelsChanged()
            yield

    def costs(self, *, wait: bool = True) -> tuple | None:
        """(target, draft) pass-cost curves (app.engine.timing.CostCurve) for adaptive DSBD forests: the cost
        profile's, or the calibration auto mode uses, read from the timing cache or timed on first use (seconds;
        answers run between the timed points). The draft's is None without a draft model. wait=False: None
        while another thread times them."""
        self._require()
        if self.policy is None and not wait:
            return None
        self._calibrated()
        policy = self.policy
        return policy.target_cost, policy.draft_cost

    def prepare(self) -> None:
        """Make the llama.cpp contexts the next answers reuse, now: a context with every sequence id forests may
        need takes up to a second or so to create, which the first answer after a load would otherwise wait for.
        They hold the most rows any request may ask for (rows cost llama.cpp's unified cache no memory) and the
        engine's context length; PyTorch contexts, whose KV is per row, are still made by the answer that needs
        them. Waits for a running answer."""
        rows = max(f.rows(MAX_BEAMS) for f in MODE_FACTS.values())
        for role in ("target", "draft"):  # one at a time: an answer asked meanwhile waits for one context at most
            with self.lock, self._native:
                if self._closed:
                    return
                model = self.target if role == "target" else self.draft
                facts = RUNTIMES.get(model.info.backend) if model is not None else None
                if facts is not None and facts.unified_kv:
                    self._context(role, rows, 0)

    def use_cost_profile(self, name: str) -> dict:
        """Price adaptive forests and auto mode with a named cost profile (app.engine.timing; "timed": this
        machine's timed passes). Returns describe()."""
        try:
            prof = cost_profile(name)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        if prof.datasheet is not None:
            self._placed(prof)  # fails here, not at the first answer; placed again after a model swap
        with self.lock:
            self.cost_profile, self.policy = prof, None
        return self.describe()

    def _placed(self, prof):
        """A datasheet profile priced for these models as a plan would place them in its machine's VRAM."""
        from app.engine.planning import placed_profile
        from offload.plan import PlanError

        specs = getattr(self, "specs", None)
        if specs is None or specs[0] is None:
            raise ConfigError(f"the cost profile {prof.name} prices passes from the model files: load the models "
                              "from files (a preset or a path) to use it")
        try:
            return placed_profile(prof, *specs)
        except (PlanError, BackendError) as e:
            raise ConfigError(f"cannot price the cost profile {prof.name} for these models: {e}") from e

    def machine_class(self) -> str:
        """"gpu" or "cpu": the class of machine forests are shaped for (the cost profile's, else where the
        target's layers are); the presets carry caps per class."""
        if self.cost_profile.machine:
            return self.cost_profile.machine
        place = getattr(self.plan, "target", None)
        return "gpu" if place is not None and (place.gpu_layers or place.streamed_layers) else "cpu"

    def observe(self, params: DecodeParams, stats: dict) -> None:
        """Learn from a finished answer (auto's acceptance and speed estimates); params as it ran."""
        self._finished.append((params, stats))
        if self.policy is not None:
            self.policy.observe(params, stats)
            for costs in self.policy.passes:  # the curves learnt from this answer's passes: kept for later starts
                if costs is not None and costs.ratios and costs.setting not in self._unsaved:
                    self.learned.store(costs.setting, passes=costs.ratios)

    def encode(self, messages: list[dict]) -> list[int]:
        self._require()
        return encode_chat(messages, self.tokenizer)

    def remember_chats(self, chats: Sequence[list[dict]]) -> None:
        """Saved chats (each its messages as the model sees them, newest chat first) for the cross-chat index;
        encoded at the next generation, so a start stays quick."""
        self._saved, self._saved_due = [list(c) for c in chats], bool(chats)

    def _fill_corpus(self) -> None:
        """The remembered chats into the cross-chat index, newest first up to its bound, added oldest first (the
        index drops its oldest); a chat this process already answered keeps its own, newer version."""
        self._saved_due = False
        picked, seen, total = [], set(self.corpus.docs), 0
        for messages in self._saved:
            if total >= self.corpus.max_tokens:
                break
            try:
                ids = encode_chat(messages, self.tokenizer)
            except ChatError:
                continue  # a template that cannot render it: that chat is only left out
            key = chat_key(ids)
            if key not in seen:
                seen.add(key)
                picked.append((key, ids))
                total += len(ids)
        for key, ids in reversed(picked):
            self.corpus.add(key, ids)

    def generate(self, prompt: Sequence[int], params: DecodeParams, *,
                 cancel: threading.Event | None = None) -> Iterator[Event]:
        """Stream one completion of `prompt` (token ids). Raises ConfigError before any work."""
        self._require()
        prompt = list(prompt)
        if not prompt:
            raise ConfigError("the prompt is empty")
        params, auto = params.validated(), None
        if params.mode == "auto":
            params, auto = self._pick(params)
        params, notice = self._resolve(params)
        tree = tree_tokens(params)
        if len(prompt) + params.max_new_tokens + tree > self.n_ctx:
            raise PromptTooLong(prompt=len(prompt), max_new=params.max_new_tokens, tree=tree, n_ctx=self.n_ctx)
        # Adaptive forests price each iteration with the pass costs (the first use times them). While another
        # thread times them (the load's warm-up), the answer runs without a forest: the plain step of the same
        # law, from the same stream.
        costs = None
        if params.adaptive:
            costs = self.costs(wait=not self._warming.is_set())
            if costs is None:
                params = replace(params, forest="fixed", gamma=0)
                why = "the pass costs are still being timed: this answer ran without a draft forest"
                notice = f"{notice}; {why}" if notice else why
        return self._run(prompt, params, cancel, self.target, notice, auto, costs)

    def _run(self, prompt, params, cancel, encoded_for, notice, auto=None, costs=None) -> Iterator[Event]:
        """Decode; an out-of-memory error before the first event frees the caches and retries once with a
        lighter setting (memory-reduced DSBD, fewer beams), telling the user. The row math running out of a
        device's memory moves it to the host instead (the numpy reference), for this answer and the next."""
        started = False
        try:
            for ev in self._decode(prompt, params, cancel, encoded_for, notice, auto, costs):
                started = True
                yield ev
        except Exception as e:
            if rowmath.out_of_memory(e) and (gone := rowmath.fall_back(e)) is not None:
                self._free()  # contexts made for device rows are made again for host rows
                if started:
                    raise OutOfMemory(f"the row math ({gone}) ran out of memory during this answer; it runs on the "
                                      "host now (the numpy reference): send the message again") from e
                why = f"the row math ({gone}) ran out of memory: this answer ran on the host (the numpy reference)"
                yield from self._run(prompt, params, cancel, encoded_for, f"{notice}; {why}" if notice else why,
                                     auto, costs)
                return
            if not _is_oom(e):
                raise
            self._free()
            lighter = _lighter(params)
            if started or lighter is None:
                raise _oom_error(params, e) from e
            why = (f"out of memory with {params.mode} and {params.beams} beams: retried with "
                   f"{lighter.mode} and {lighter.beams} beams")
            try:
                yield from self._decode(prompt, lighter, cancel, encoded_for, f"{notice}; {why}" if notice else why,
                                        auto, costs)
            except Exception as again:
                if not _is_oom(again):
                    raise
                self._free()
                raise _oom_error(lighter, again, retried=True) from again

    def _free(self) -> None:
        """Drop every KV context (they are rebuilt on demand) and return cached device memory."""
        with self.lock:
            for _, ctx, _ in self._ctx.values():
                ctx.close()
            self._ctx.clear()
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _decode(self, prompt, params, cancel, encoded_for, notice, auto=None, costs=None) -> Iterator[Event]:
        facts = MODE_FACTS[params.mode]
        rows = facts.rows(params.beams)
        # Rows of a unified cache share the prompt but each holds its own answer (worst case).
        tree = tree_tokens(params)
        cells = len(prompt) + rows * params.max_new_tokens + tree
        with self.lock:
            if cancel is not None and cancel.is_set():  # cancelled while waiting for the lock
                yield Event(text="", tokens=0, live_beams=0, done=True,
                            stats={"mode": params.mode, "finish_reason": "cancelled", "new_tokens": 0})
                return
            if self.target is None:  # unloaded while this request waited
                raise NoModelLoaded()
            if self.target is not encoded_for:  # a model swap went through while this request waited
                raise BackendError("the models changed while this request waited; send it again")
            if self._saved_due:
                self._fill_corpus()
            target = self._context("target", rows, cells)
            drafts = params.uses_draft and self.draft is not None
            draft = self._context("draft", rows, cells) if drafts else None
            # Unique paths (spec §16.1) score each distinct sequence once; either wrapper counts the tokens.
            # The decoders read each pass's rows before the next call, so those are read in place, except the
            # draft's under sps, which keeps a chain's rows across its passes.
            if params.unique_paths:
                target = UniquePaths(target, views=True)
                draft = UniquePaths(draft, views=MODE_FACTS[params.mode].forest) if draft is not None else None
            else:
                target = CountingContext(target)
                draft = CountingContext(draft) if draft is not None else None
            tok = self.tokenizer
            stopper = Stopper(eos_ids=tok.eos_ids, stop=params.stop, decode=tok.decode)
            metrics = Metrics(mode=params.mode, prompt_tokens=len(prompt))
            policy = self._forest_policy(params, costs) if drafts else None
            nodes = self._node_builder(params, prompt, stopper, costs)
            steps = start(params, target=target, draft=draft, prompt=prompt, stopper=stopper, metrics=metrics,
                          vocab=self.target.info.vocab_size, costs=costs if policy is None else None,
                          policy=policy, nodes=nodes)
            try:
                for step in steps:
                    if cancel is not None and cancel.is_set() and not step.done:
                        metrics.finish_reason = "cancelled"
                        text = stopper.visible_text(step.final, final=True)
                        yield Event(text=text, tokens=len(step.final), live_beams=0, done=True,
                                    stats=self._stats(metrics, step.final, None, target, draft))
                        return
                    text = stopper.visible_text(step.final, final=step.done)
                    if step.done:
                        stats = self._stats(metrics, step.output.tokens, step.output.score, target, draft)
                        drafted, segments = step.output.drafted, None
                        if drafted:  # how much of the answer the draft wrote (accepted by the target)
                            stats["draft_tokens"] = sum(drafted)
                            segments = stopper.runs(step.output.tokens, drafted)
                        self.observe(params, stats)
                        self.corpus.add(chat_key(prompt), list(prompt) + list(step.output.tokens))
                        if notice:
                            stats["notice"] = notice
                        if auto:
                            stats["auto"] = auto
                        yield Event(text=text, tokens=len(step.output.tokens), live_beams=0, done=True,
                                    stats=stats, forest=_with_pass(step.forest, target), notice=notice,
                                    segments=segments)
                        return
                    yield Event(text=text, tokens=len(step.final), live_beams=step.live, notice=notice,
                                forest=None if step.forest is None else _with_pass(step.forest, target))
            except ContextFull as e:
                raise BackendError(f"the context filled up during generation: {e}") from e
            finally:
                steps.close()  # the decoder's own cleanup; the next prefill drops any pending forest
                self._remember(policy, nodes)

    def _forest_policy(self, params: DecodeParams, costs):
        """Adaptive DSBD with a draft model: a forest policy starting from what this model pair learnt at this
        setting and cost profile (in memory, else from the cache folder); None for fixed forests (generate()
        timed the `costs` of an adaptive one)."""
        if costs is None or costs[1] is None:
            return None
        from app.decoding.forest_policy import Acceptance, ForestPolicy, decoder_costs, setting_key

        key = self._learn_key("acceptance", (self.target, self.draft), self.cost_profile.name, setting_key(params))
        known = self._acceptance.get(key) or self.learned.acceptance(key) or Acceptance()
        policy = ForestPolicy.for_params(params, *costs, explore=EXPLORE_LAYERS, known=known.carried(),
                                         max_drafts=self._forest_budget(params),
                                         **decoder_costs(params, self.target.info.vocab_size))
        policy.setting = key
        return policy

    def _node_builder(self, params: DecodeParams, prompt, stopper, costs):
        """DSBD's model-free lookup nodes (params.lookup_sources), calibrated by what earlier answers on this
        target saw; None when params name no model-free source."""
        from app.decoding.dsbd import model_free_builder, model_free_sources

        if not model_free_sources(params):
            return None  # nothing to build: the model identity need not be read
        key = self._learn_key("calibration", (self.target,))
        known = self._calibration.get(key) or self.learned.calibration(key)
        builder = model_free_builder(params, prompt, stopper, self.target.info.vocab_size,
                                     target_cost=costs[0] if costs is not None else None,
                                     calibration=known.carried() if known is not None else None)
        if builder is not None:
            builder.setting = key
            builder.use_corpus(self.corpus, exclude=chat_key(prompt))  # this chat is in its prompt already
        return builder

    def _learn_key(self, kind: str, models, *extra) -> str:
        """The key of what is learnt about these models: persisted when every model has a file identity (a
        model without one, a test's table, learns in memory only)."""
        ids = [model_key(m) for m in models]
        if None in ids:
            key = entry_key(kind, [_model_id(m) for m in models], *extra, "memory")
            self._unsaved.add(key)
            return key
        return entry_key(kind, ids, *extra)

    def _remember(self, policy, nodes) -> None:
        """What this answer taught (cancelled or not) starts the next one, here and in later processes."""
        if policy is not None and policy.setting is not None:
            self._acceptance[policy.setting] = policy.known
            if policy.setting not in self._unsaved:
                self.learned.store(policy.setting, acceptance=policy.known)
        if nodes is not None and nodes.setting is not None:
            self._calibration[nodes.setting] = nodes.calibration
            if nodes.setting not in self._unsaved:
                self.learned.store(nodes.setting, calibration=nodes.calibration)

    @staticmethod
    def _stats(metrics: Metrics, tokens, score, target=None, draft=None) -> dict:
        metrics.t_end = time.perf_counter()
        metrics.new_tokens = len(tokens)
        if score is not None:
            metrics.score = score
        stats = metrics.as_dict()
        for prefix, ctx in (("", target), ("draft_", draft)):  # tokens asked for vs fed, per pass
            if isinstance(ctx, CountingContext):
                c = ctx.counters()
                stats[f"{prefix}query_tokens_per_pass"] = c["query_tokens_per_pass"]
                stats[f"{prefix}distinct_tokens_per_pass"] = c["distinct_tokens_per_pass"]
                stats[f"{prefix}passes_by_tokens"] = c["passes_by_tokens"]  # for projections (app/compare)
                stats[f"{prefix}pass_s"] = c["pass_s"]
                stats[f"{prefix}pass_s_by_tokens"] = c["pass_s_by_tokens"]  # what the curves learn (PassCosts)
        if isinstance(target, CountingContext):
            stats["unique_paths"] = isinstance(target, UniquePaths)
        return stats

    def complete(self, prompt: Sequence[int], params: DecodeParams, *, n: int = 1) -> list[dict]:
        """N independent completions (derived seeds), each {text, tokens, stats}."""
        out = []
        for i in range(n):
            p = replace(params, seed=derive_seed(params.seed, i)) if n > 1 else params
            last = final_event(self.generate(prompt, p))
            out.append({"text": last.text, "tokens": last.tokens, "stats": last.stats})
        return out


EXPLORE_LAYERS = 32  # adaptive forests may explore (within budget) until a model pair has this many verified layers


def settle_heap() -> None:
    """After models load: collect, then freeze what lives (every object until now, the models' tokenizer tables
    and metadata among them: about 280,000 for the qwen-coder pair) out of the garbage collector's sight. Its
    full collections walk every object it sees; one over the loaded pair took 141 ms, inside an answer
    (docs/measurements/rowmath.md, section 20). Thawed first, so what died since the last freeze (a swapped-out
    model's cycles) is collected, and nothing stays frozen past the next load or swap."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def _model_id(model) -> tuple | None:
    """What a model's acceptance belongs to: its runtime, name and file."""
    return None if model is None else (model.info.backend, model.info.name, model.info.extra.get("path"))


def _with_pass(forest: dict | None, target) -> dict | None:
    """The decoder's forest snapshot plus the tokens its target pass was asked for and was fed."""
    if forest is None or not isinstance(target, CountingContext):
        return forest
    return {**forest, "query_tokens": target.last_query, "distinct_tokens": target.last_distinct}


def final_event(events: Iterator[Event]) -> Event:
    """Drain a generation's stream; its last event carries the final text and stats."""
    last = None
    for last in events:
        pass
    if last is None:
        raise BackendError("the engine returned no events")
    return last


def memory_plan(target: ModelSpec, draft: ModelSpec | None, *, budget=None):
    """The offload plan for these models at default decoding settings; PlanError when nothing fits.
    Files the planner cannot read (an unknown architecture, say) load unplanned."""
    from app.engine.planning import PlanError, plan_for

    if target.rpc:  # the target's layers live on RPC workers: this host's plan would overcount
        log.info("no memory plan for %s: its layers go to the RPC workers %s", target.source, ", ".join(target.rpc))
        return None
    try:
        return plan_for(target, draft, budget=budget)
    except PlanError:
        raise
    except Exception as e:  # the plan is advice; a model it cannot size still loads
        log.warning("no memory plan for %s: %s", target.source, e)
        return None


_POLL_S = 0.1  # how often a swap waiting for the running answer looks at its cancel Event


def _plan(target: ModelSpec, draft: ModelSpec | None, tracker: LoadTracker, *, budget=None, keep=None):
    """The memory plan, after resolving each file to load under its role (so a preset's assembly and hashing
    report as that role's stages); `keep(role, spec)`: a model already serving, nothing to resolve."""
    from backends.modelfiles.resolution import resolve

    for role, spec in (("target", target), ("draft", draft)):
        if spec is not None and not (keep and keep(role, spec)):
            tracker.role = role
            tracker.check()
            resolve(spec.source, role=role)
    tracker.role = None
    tracker.check()
    return memory_plan(target, draft, budget=budget)


def _load_role(spec: ModelSpec, role: str, plan, tracker: LoadTracker):
    """load_planned under `role`'s name in the tracker's reports."""
    tracker.role = role
    tracker.report("load", 0.0, spec.source)
    model = load_planned(spec, role, plan)
    tracker.tell("load", 1.0, spec.source)
    return model


def load_planned(spec: ModelSpec, role: str, plan):
    """Load one model as `plan` places it: its n_gpu_layers (llama.cpp), or its layers streamed to the GPU
    (a streaming runtime: PyTorch)."""
    from backends.registry import load_model

    place = None if plan is None else (plan.target if role == "target" else plan.draft)
    if place is None:
        return load_model(spec, role=role)
    if not RUNTIMES[place.runtime].streams_layers:
        if spec.n_gpu_layers is None:
            spec = replace(spec, n_gpu_layers=place.n_gpu_layers or 0)
        return load_model(spec, role=role)
    if not spec.device.startswith("cuda") or place.streamed_layers == 0:
        return load_model(spec, role=role)
    from offload.stream import offload_model

    model = load_model(replace(spec, device="cpu"), role=role)  # then stream what VRAM cannot hold
    try:
        offload_model(model, gpu_layers=place.gpu_layers, device=spec.device, ring=place.ring or 2)
    except BaseException:
        model.close()
        raise
    return model


CHAT_KEY_TOKENS = 32  # a chat is known by its prompt's first tokens (template, system prompt, first words)


def chat_key(prompt: Sequence[int]) -> int:
    """The cross-chat index's key of the chat a prompt continues: a chat grows at its end, so its later prompts
    keep the key (and replace its entry); two chats opening with the same ~25 words share one entry."""
    return hash(tuple(prompt[:CHAT_KEY_TOKENS]))


class _ModelsChanged(Exception):
    """The models were swapped while their passes were being timed."""


def _is_oom(e: BaseException) -> bool:
    # The runtimes translate their own allocation failures into OutOfMemory; MemoryError is Python's; torch's own
    # (the row math's on the host) come as its OutOfMemoryError or its CPU allocator's RuntimeError.
    return isinstance(e, (OutOfMemory, MemoryError)) or rowmath.out_of_memory(e)


def _oom_error(params: DecodeParams, e: BaseException, *, retried: bool = False) -> OutOfMemory:
    again = " (already retried with a lighter setting)" if retried else ""
    return OutOfMemory(f"out of memory during {params.mode} with {params.beams} beams{again} "
                        f"({e.__class__.__name__}): try dsbd-mem, fewer beams, a shorter context or more "
                        "offloading (see dsbd-chat plan)")


def _lighter(params: DecodeParams) -> DecodeParams | None:
    """One step down in memory: full DSBD -> memory-reduced; otherwise half the beams; None at the floor."""
    facts = MODE_FACTS[params.mode]
    if facts.memory_twin:
        return replace(params, mode=facts.memory_twin)
    if facts.beams and params.beams > 1:
        w = params.beams // 2
        return replace(params, beams=w, min_beams=min(params.min_beams, w),
                       draft_beams=max(w, params.draft_beams or w) if facts.forest else None).validated()
    return None
