"""LLMEngine: model + KV pool + radix cache + scheduler, driven one step at a time.

``step()`` asks the scheduler what to feed, runs one forward pass over it, samples for the
requests whose pending tokens are all fed, applies stop rules and returns per-request deltas.
``generate()`` is the offline convenience over the same loop. The server drives ``step()``
from a background thread (engine/async_engine.py). A step with nothing to run while loads are in
flight (requests LOADING, engine/admission.py) waits until a load has news (``wake``, at most
``IDLE_WAIT_S``) instead of spinning: on a small machine a spinning loop would take the CPU the
loads need. Plug-ins are built with ``view`` (engine/hooks.py ``EngineView``), never with the engine;
what they ``submit`` joins the queue between steps.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import torch
from prometheus_client.registry import Collector

from engine import cpu_gemm
from engine.attention import select_backend
from engine.config import EngineConfig
from engine.errors import EngineError, InvalidRequestError
from engine.forward_batch import ForwardBatch
from engine.hooks import AdmissionHook, EngineView, KVConnectorPlugin, LoadingHook
from engine.kv_pool import KVPool
from engine.limits import check_stop
from engine.model import LlamaModel
from engine.model_loader import LoadedModel, load_model
from engine.radix_cache import EvictedNode, RadixCache
from engine.request import HookState, Request, RequestOutput, Status
from engine.sampling import SamplingParams, sample
from engine.scheduler import Scheduler
from engine.shared_prefix import SharedPrefixes
from engine.stop import StopChecker

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # longest wait of a step with nothing to run but loads in flight


def _pick_device(cfg: EngineConfig) -> torch.device:
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def _pick_dtype(cfg: EngineConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.cfg = config
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        self.device = _pick_device(config)
        self.dtype = _pick_dtype(config, self.device)
        self.loaded = loaded if loaded is not None else load_model(config.model)
        self.arch = self.loaded.arch
        self.tokenizer = self.loaded.tokenizer
        self.model = LlamaModel(self.arch, self.loaded.weights, self.device, self.dtype)
        if self.device.type == "cpu" and config.cpu_gemm != "linear":
            self.model.linear = cpu_gemm.for_weights(self.loaded.fingerprint, self.model.weights(),
                                                     quiet_wait_s=config.cpu_gemm_quiet_wait_s,
                                                     native=config.cpu_gemm == "auto")
        num_pages = config.num_pages or KVPool.pages_for_budget(self.arch, config.kv_memory, config.page_size,
                                                                  self.dtype)
        self.pool = KVPool(self.arch, num_pages, config.page_size, self.dtype, self.device)
        shared = SharedPrefixes.from_file(config.shared_prefix_file, self.tokenizer, config.page_size) \
            if config.shared_prefix_file else None
        self.radix = RadixCache(config.page_size, self.pool.allocator, on_evict=self._on_evict, shared=shared)
        # plug-ins, set by the composition root (connector/wiring.py); the engine runs without them
        self.evict_listeners: list[Callable[[list[EvictedNode]], None]] = []
        #: told after each step: (tokens fed, tokens already cached) per sequence, and the step's
        #: seconds (forward and sampling) — what the connector's prefill model learns from
        self.step_listeners: list[Callable[[list[tuple[int, int]], float], None]] = []
        self.metric_collectors: list[Collector] = []  # of plug-ins, served on /metrics
        self.attn = select_backend(config.attention_backend, self.device)
        self.max_model_len = config.max_model_len or self.arch.max_position_embeddings
        self.scheduler = Scheduler(config, self.pool, self.radix, self.max_model_len)
        self.stop = StopChecker(self.tokenizer, self.arch.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._submitted: deque[Request] = deque()  # by plug-ins (``submit``): admitted after the step
        self.default_generator = torch.Generator().manual_seed(config.seed)
        #: what plug-ins are built with (connector/wiring.py): never this engine itself
        self.view = EngineView(self.arch, self.loaded.fingerprint, self.device, self.dtype, self.pool, self.model,
                               self._forward, self.radix.shared, self.scheduler.cache.pages, self.submit)
        log.info("engine ready: %s on %s/%s, %d pages x %d tokens, attention=%s", self.loaded.name,
                 self.device, self.dtype, num_pages, config.page_size, self.attn.name)

    # -- hooks -------------------------------------------------------------------------
    def _on_evict(self, nodes: list[EvictedNode]) -> None:
        for fn in self.evict_listeners:
            fn(nodes)

    def close_plugins(self, grace_s: float) -> bool:
        """Shutdown: each hook in order flushes its staged offloads (a KV connector: at most
        ``grace_s``) and is closed. False if a flush timed out (what was still staged is dropped)."""
        ok = True
        for hook in self.hooks:
            if isinstance(hook, KVConnectorPlugin):
                flushed = hook.flush(grace_s)
                log.info("staged KV offloads %s", "flushed" if flushed else f"NOT flushed within {grace_s:.0f}s")
                ok = ok and flushed
            hook.close()
        return ok

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.forward(batch, self.pool, self.attn)

    # -- requests ----------------------------------------------------------------------
    def _request(self, prompt: str | Sequence[int], params: SamplingParams | None, rid: str | None,
                 cache_salt: str | None, extras: Mapping[str, HookState] | None) -> Request:
        params = params or SamplingParams()
        check_stop(self.cfg, params.stop, params.stop_token_ids)  # the server checked an API request already
        ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if any(t < 0 or t >= self.arch.vocab_size for t in ids):
            raise InvalidRequestError(f"token ids must be in [0, {self.arch.vocab_size})", "prompt")
        rid = rid or uuid.uuid4().hex
        if rid in self.requests or any(r.rid == rid for r in self._submitted):
            raise InvalidRequestError(f"duplicate request id {rid}")
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else self.default_generator
        return Request(rid, list(ids), params, cache_salt=cache_salt, generator=gen, extras=dict(extras or {}))

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    rid: str | None = None, cache_salt: str | None = None,
                    extras: Mapping[str, HookState] | None = None) -> str:
        """Queue a request; ``extras``: its plug-ins' state, each under its plug-in's key (``Request.extras``)."""
        req = self._request(prompt, params, rid, cache_salt, extras)
        self.scheduler.add(req)  # raises PromptTooLongError before anything is held
        self.requests[req.rid] = req
        return req.rid

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, *, rid: str | None = None,
               cache_salt: str | None = None, extras: Mapping[str, HookState] | None = None) -> str:
        """A plug-in's request (engine/hooks.py ``Submit``): checked now (EngineError: nothing queued),
        admitted after the current step, so a hook never re-enters the scheduler (its ``on_finish`` runs
        inside ``Scheduler.finish``)."""
        req = self._request(prompt_ids, params, rid, cache_salt, extras)
        self.scheduler.check_fits(len(req.prompt_ids), req.params.max_tokens)
        self._submitted.append(req)
        return req.rid

    def _admit_submitted(self) -> None:
        """Between steps: the plug-ins' submissions join the queue, in order."""
        while self._submitted:
            req = self._submitted.popleft()
            try:
                self.scheduler.add(req)
            except EngineError as e:
                log.warning("%s: submitted request dropped: %s", req.rid, e)
                continue
            self.requests[req.rid] = req

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)
        self.requests.pop(rid, None)
        self._submitted = deque(r for r in self._submitted if r.rid != rid)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._submitted)

    @property
    def hooks(self) -> list[AdmissionHook | LoadingHook]:
        """The admission hooks, in the order the composition root set (loading hooks first)."""
        return self.scheduler.admitter.hooks

    @hooks.setter
    def hooks(self, hooks: Sequence[AdmissionHook | LoadingHook]) -> None:
        self.scheduler.admitter.hooks = hooks

    @property
    def wake(self) -> threading.Event:
        """Set when a load has news or a caller queued a command: ends an idle step's wait."""
        return self.scheduler.wake

    # -- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step; what plug-ins submitted before it (between steps) or during it joins the queue
        after the scheduler is done with its calls."""
        self._admit_submitted()
        outs = self._step()
        self._admit_submitted()
        return outs

    def _step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if not plan:
            if self.scheduler.waiting_on_loads():
                self.scheduler.wake.wait(IDLE_WAIT_S)
            return []
        t0 = time.perf_counter()
        prompt_tokens = sum(n for req, n in plan if n > 1 or req.num_computed < len(req.prompt_ids))
        seqs, needs_logits = [], []
        for req, n in plan:
            start = req.num_computed
            seqs.append((req.ids_between(start, start + n), start, req.pages))
            needs_logits.append(start + n == req.num_tokens)
        batch = ForwardBatch.build(seqs, self.pool.page_size, self.device, logits=needs_logits)
        logits = self.model.forward(batch, self.pool, self.attn)
        outs: list[RequestOutput] = []
        row = 0
        now = time.monotonic()
        for (req, n), want in zip(plan, needs_logits, strict=True):
            req.num_computed += n
            if not want:
                continue
            tok = sample(logits[row], req.params, req.generator)
            row += 1
            if req.first_token_time is None:
                req.first_token_time = now
            req.output_ids.append(tok)
            new_text, reason = self.stop.update(req)
            if reason is not None:
                self.scheduler.finish(req, reason)
                self.requests.pop(req.rid, None)
            outs.append(RequestOutput(req.rid, [tok], new_text, req.finished, req.finish_reason,
                                      len(req.prompt_ids), len(req.output_ids), req.cached_tokens,
                                      usage=req.usage))
        dt = time.perf_counter() - t0
        self.scheduler.step_cost.observe(prompt_tokens, dt)
        if self.step_listeners:
            shape = [(n, start) for (_, start, _), (_, n) in zip(seqs, plan, strict=True)]
            for fn in self.step_listeners:
                fn(shape, dt)
        return outs

    # -- offline convenience -------------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
                 | None = None) -> list[Request]:
        plist = params if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        reqs = {rid: self.requests[rid] for rid in rids}
        while any(r.status is not Status.FINISHED for r in reqs.values()):
            self.step()
        return [reqs[r] for r in rids]
