"""Drive an LLMEngine from a background thread and stream its outputs to asyncio callers.

The engine is single-threaded by design: only the loop thread touches it. Callers submit
commands (add / abort) through a queue and receive RequestOutputs on an asyncio.Queue per
request, handed across with ``loop.call_soon_threadsafe``. A command sets the engine's own
``wake`` event, so it also ends the short wait of a step that only had loads in flight.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from engine.engine import LLMEngine
from engine.errors import EngineDeadError, EngineError
from engine.metrics import EngineMetrics
from engine.request import HookState, RequestOutput
from engine.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Add:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    extras: Mapping[str, HookState] | None
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    t0: float
    ttft: float | None = None


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: EngineMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics or EngineMetrics()
        self.metrics.kv_pages.set(engine.pool.num_pages)
        for collector in getattr(engine, "metric_collectors", []):
            self.metrics.registry.register(collector)
        self._cmds: queue.Queue = queue.Queue()
        self._wake = engine.wake  # shared with the loads' workers: either ends an idle wait
        self._sinks: dict[str, _Add] = {}
        self._stop = False
        self.dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    # -- caller side ---------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError/PromptTooLongError before anything is queued. Costs time in the
        prompt's length: the server runs it off the event loop, with the tokeniser."""
        from engine.errors import InvalidRequestError
        from engine.limits import check_prompt_tokens, check_stop

        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        check_prompt_tokens(self.engine.max_model_len, len(prompt_ids))  # before looking at each id
        check_stop(self.engine.cfg, params.stop, params.stop_token_ids)
        vocab = self.engine.arch.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidRequestError(f"token ids must be in [0, {vocab})", "prompt")
        self.engine.scheduler.check_fits(len(prompt_ids), params.max_tokens)

    async def generate(self, rid: str, prompt_ids: list[int], params: SamplingParams,
                       cache_salt: str | None = None,
                       extras: Mapping[str, HookState] | None = None) -> AsyncIterator[RequestOutput]:
        """Stream outputs of one request (call validate() first for an early, synchronous 400)."""
        if self.dead is not None:
            raise EngineDeadError(f"engine loop died: {self.dead!r}")
        sink: asyncio.Queue = asyncio.Queue()
        self._cmds.put(_Add(rid, prompt_ids, params, cache_salt, extras, sink, asyncio.get_running_loop(),
                            time.monotonic()))
        self._wake.set()
        finished = False
        try:
            while True:
                out = await sink.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            if not finished:  # the caller went away (client disconnect): free the pages
                self.abort(rid)

    def abort(self, rid: str) -> None:
        self._cmds.put(("abort", rid))
        self._wake.set()

    # -- loop thread ---------------------------------------------------------------------
    def _deliver(self, add: _Add, item: object) -> None:
        add.loop.call_soon_threadsafe(add.sink.put_nowait, item)

    def _apply(self, cmd: object) -> None:
        eng = self.engine
        if isinstance(cmd, _Add):
            try:
                eng.add_request(cmd.prompt_ids, cmd.params, rid=cmd.rid, cache_salt=cmd.cache_salt, extras=cmd.extras)
                self._sinks[cmd.rid] = cmd
                self.metrics.prompt_tokens.inc(len(cmd.prompt_ids))
            except EngineError as e:
                self._deliver(cmd, e)
        else:
            _, rid = cmd
            if rid in self._sinks:
                eng.abort(rid)
                self._sinks.pop(rid, None)
                self.metrics.requests.labels("abort").inc()

    def _run(self) -> None:
        eng, m = self.engine, self.metrics
        try:
            while not self._stop:
                if not eng.has_unfinished() and self._cmds.empty():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                while not self._cmds.empty():
                    self._apply(self._cmds.get_nowait())
                outs = eng.step() if eng.has_unfinished() else []
                now = time.monotonic()
                for out in outs:
                    add = self._sinks.get(out.rid)
                    if add is None:
                        continue
                    if out.completion_tokens == 1:
                        m.ttft.observe(now - add.t0)
                        m.prefix_hit_tokens.inc(out.cached_tokens)
                        if out.usage is not None:
                            m.count_usage(out.usage)
                    m.generation_tokens.inc(len(out.new_token_ids))
                    if out.finished:
                        m.e2e.observe(now - add.t0)
                        if out.completion_tokens > 1 and add.ttft is not None:
                            m.tpot.observe((now - add.t0 - add.ttft) / (out.completion_tokens - 1))
                        m.requests.labels(out.finish_reason or "unknown").inc()
                        self._sinks.pop(out.rid, None)
                    elif out.completion_tokens == 1:
                        add.ttft = now - add.t0
                    self._deliver(add, out)
                m.queue_depth.set(len(eng.scheduler.waiting))
                m.running.set(len(eng.scheduler.running))
                m.kv_usage.set(eng.pool.usage())
                m.preemptions.set(eng.scheduler.num_preemptions)
        except BaseException as e:  # report to every waiter instead of hanging them
            log.exception("engine loop died")
            self.dead = e
            for add in list(self._sinks.values()):
                self._deliver(add, EngineDeadError(f"engine loop died: {e!r}"))
            self._sinks.clear()
