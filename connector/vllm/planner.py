"""The scheduler half of the vLLM connector: what to load, what to save, as plain data.

vLLM's scheduler asks ``get_num_new_matched_tokens`` when it admits a request, after its own
local prefix match; ``matched`` answers it: the keys of the full blocks after the local hit, one
Lookup to the daemon (bounded by ``lookup_deadline_s``; a failure means recompute, and lookups are
skipped for ``retry_after_failure_s`` so a dead daemon costs one deadline, not one per request),
and the same load-aware cost model kvengine uses (connector/cost_model.py) on a prefill model
fitted to this replica's own steps (calibration.py). The answer is cached per request, so the
scheduler may ask as often as it likes. A load is asynchronous (``(n, True)``: vLLM keeps stepping
other requests while it runs), unless the cost model predicts it takes at most ``sync_load_max_s``:
then it runs inside the step that schedules the request (``(n, False)``), because an asynchronous
load waits two engine steps (it starts at the next step and is reported at that step's end), and on
a busy replica a step with other prefills in it takes far longer than a small load from a local
tier (bench.vllm: 0.9 s of queueing against loads of 12 ms).

``allocated`` turns vLLM's allocation into a ``LoadSpec``; ``build`` (each step) hands out the
loads and the write-through saves: every block that is full once the step's forward has run and
that the daemon is not known to hold (a block loaded from it, held by it, or saved already).
``report`` folds the worker's measurements back in: step times into the prefill fit, load times
into the tiers' bandwidths, and loads that fell short into forgotten keys.

Nothing here imports vLLM: connector/vllm/connector.py translates vLLM's objects into these calls.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from connector.cost_model import CostModel, Decision, EngineLoad, PrefillModel
from connector.offload import KnownKeys
from connector.vllm.calibration import PrefillCalibrator
from connector.vllm.config import VLLMConnectorConfig
from connector.vllm.counters import Counters
from connector.vllm.keys import RequestKeys, VLLMKeySpace
from connector.vllm.meta import LoadSpec, SaveSpec, TierKVMetadata, TierKVWorkerMetadata

log = logging.getLogger(__name__)

#: lookup(keys, deadline_s) -> (leading blocks held, tier of each held block)
Lookup = Callable[[Sequence[bytes], float], tuple[int, Sequence[str | None]]]
_PLACEHOLDER = PrefillModel(0.0, 1e-3, 0.0)  # never decides: replaced by the fit before any decision


class Scheduled(NamedTuple):
    """One request in this step, as vLLM's SchedulerOutput describes it."""

    req_id: str
    computed: int  # tokens with KV before this step
    scheduled: int  # tokens this step feeds
    block_ids: Sequence[int] | None  # blocks handed out this step (None: none)
    replace: bool  # block_ids is the request's whole list (new or resumed), not an append


@dataclass
class _Req:
    keys: RequestKeys
    tokens: Sequence[int]  # vLLM's live list of the request's token ids (prompt, then outputs)
    prompt_len: int
    order: int
    block_ids: list[int] = field(default_factory=list)
    known: int = 0  # leading blocks the daemon holds (no save needed)
    computed: int = 0
    answer: tuple[int, tuple[int, bool]] | None = None  # (num_computed asked, answer)
    plan: tuple[int, int, list[str]] | None = None  # (local blocks, blocks to load, their tiers)
    decision: Decision | None = None
    loading: bool = False
    load_keys: list[bytes] = field(default_factory=list)  # the keys of the load in flight
    failed: bool = False  # a load of this request fell short: it recomputes, never loads again
    sync: bool = False  # the planned load runs inside the step that schedules the request


class Planner:
    def __init__(self, cfg: VLLMConnectorConfig, space: VLLMKeySpace, lookup: Lookup, block_bytes: int,
                 counters: Counters, clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.cfg, self.space, self._lookup, self.counters, self._clock = cfg, space, lookup, counters, clock
        self.block_size = space.block_size
        self.block_bytes = block_bytes
        self.cost = CostModel(_PLACEHOLDER, block_bytes, self.block_size, load_mode=cfg.load_mode)
        self.calibrator = PrefillCalibrator(cfg.min_prefill_samples)
        self.known = KnownKeys(cfg.known_keys)
        self._reqs: dict[str, _Req] = {}
        self._pending: list[LoadSpec] = []
        self._inflight: dict[str, tuple[str, int]] = {}  # req_id -> (main tier, bytes) of loads running
        self._order = 0
        self._step = 0
        self._skip_until = 0.0

    # -- admission ------------------------------------------------------------------------
    def add(self, req_id: str, tokens: Sequence[int], prompt_len: int, salt: str | None) -> None:
        if req_id not in self._reqs:
            self._order += 1
            self._reqs[req_id] = _Req(RequestKeys(self.space, salt), tokens, prompt_len, self._order)

    def matched(self, req_id: str, tokens: Sequence[int], prompt_len: int, salt: str | None,
                num_computed: int) -> tuple[int, bool]:  # fmt: skip
        """vLLM's ``get_num_new_matched_tokens``: tokens to load beyond its local hit, asynchronously."""
        self.add(req_id, tokens, prompt_len, salt)
        r = self._reqs[req_id]
        if r.answer is not None and r.answer[0] == num_computed:
            return r.answer[1]
        answer = self._decide(r, num_computed)
        r.answer = (num_computed, answer)
        return answer

    def _decide(self, r: _Req, num_computed: int) -> tuple[int, bool]:
        bs = self.block_size
        local = num_computed // bs
        usable = (r.prompt_len - 1) // bs  # the last prompt token is always computed (it samples)
        r.plan, r.decision = None, None
        if usable <= local or self.cfg.load_mode == "never" or r.failed:
            return 0, False
        keys = r.keys.upto(r.tokens, usable)
        ask = keys[local:usable]
        if self._clock() < self._skip_until:
            self.counters.add("lookup_skipped")
            return 0, False
        try:
            held, tiers = self._lookup(ask, self.cfg.lookup_deadline_s)
        except Exception as e:  # noqa: BLE001 - any failure of the daemon means recompute
            self.counters.add("lookup_errors")
            self._skip_until = self._clock() + self.cfg.retry_after_failure_s
            log.warning("tierkv: daemon lookup failed (%s); recomputing, next lookup in %.0f s", e,
                        self.cfg.retry_after_failure_s)
            return 0, False
        self.counters.add("blocks:looked_up", len(ask))
        self.counters.add("blocks:held", held)
        r.known = max(r.known, local + held)
        self.known.add(keys[: local + held])
        if held == 0:
            self.counters.add("decisions:none_held")
            return 0, False
        tiers = [t or "?" for t in tiers[:held]]
        model = self.calibrator.model
        load = EngineLoad(self._inflight_bytes(), self._prefill_ahead(r))
        if model is None and self.cfg.load_mode == "auto":
            self.cost.prefill = _PLACEHOLDER
            d = self.cost.explore(local * bs, r.prompt_len, tiers, load, held)._replace(outcome="uncalibrated")
        else:
            self.cost.prefill = model or _PLACEHOLDER
            d = self.cost.decide_under_load(local * bs, r.prompt_len, tiers, load)
        self.counters.add(f"decisions:{d.outcome}")
        r.decision = d
        if d.pages == 0:
            return 0, False
        r.plan = (local, d.pages, tiers[: d.pages])
        # a small load from a fast tier costs less inside the step than the two steps an
        # asynchronous one waits (started at the next step, reported at its end)
        r.sync = (self.cfg.sync_load_max_s > 0 and d.outcome != "uncalibrated"
                  and 0 < d.predicted_load_s <= self.cfg.sync_load_max_s)  # fmt: skip
        return d.pages * bs, not r.sync

    def _inflight_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for tier, n in self._inflight.values():
            out[tier] = out.get(tier, 0) + n
        return out

    def _prefill_ahead(self, r: _Req) -> list[tuple[int, int]]:
        return [(q.prompt_len - q.computed, q.computed) for q in self._reqs.values()
                if q.order < r.order and q.computed < q.prompt_len]

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM's ``update_state_after_alloc``: the blocks the load writes into."""
        r = self._reqs.get(req_id)
        if r is None or num_external_tokens <= 0 or r.plan is None or r.loading:
            return
        local, n, tiers = r.plan
        n = min(n, num_external_tokens // self.block_size)
        ids = list(block_ids[local : local + n])
        if len(ids) < n:
            log.warning("tierkv: %s got %d blocks for a %d-block load; loading none", req_id, len(ids), n)
            return
        keys = r.keys.keys[local : local + n]
        d = r.decision
        predicted = d.predicted_load_s if d is not None else 0.0
        recompute = d.predicted_recompute_s if d is not None and d.outcome != "uncalibrated" else 0.0
        deadline = min(self.cfg.load_deadline_s, max(self.cfg.load_deadline_min_s,
                                                     self.cfg.load_deadline_factor * predicted, recompute))
        if r.sync:  # it stalls the whole step while it runs: a short leash
            deadline = self.cfg.sync_load_deadline_s
        self._pending.append(LoadSpec(req_id, list(keys), ids, list(tiers[:n]), deadline, sync=r.sync))
        r.load_keys = list(keys)
        self._inflight[req_id] = (max(set(tiers), key=tiers.count) if tiers else "?", n * self.block_bytes)
        r.loading = True
        r.known = max(r.known, local + n)

    # -- each step ------------------------------------------------------------------------
    def build(self, scheduled: Sequence[Scheduled]) -> TierKVMetadata:
        """vLLM's ``build_connector_meta``: this step's loads and saves, and what it feeds."""
        self._step += 1
        meta = TierKVMetadata(step=self._step, loads=self._pending)
        self._pending = []
        bs = self.block_size
        for s in scheduled:
            r = self._reqs.get(s.req_id)
            if r is None:
                continue
            if s.block_ids is not None:
                r.block_ids = list(s.block_ids) if s.replace else r.block_ids + list(s.block_ids)
            meta.seqs.append((s.scheduled, s.computed))
            r.computed = s.computed + s.scheduled
            if not self.cfg.save:
                continue
            full = min(r.computed, len(r.tokens), len(r.block_ids) * bs) // bs
            if full <= r.known:
                continue
            keys = r.keys.upto(r.tokens, full)
            todo = [(k, b) for k, b in zip(keys[r.known : full], r.block_ids[r.known : full], strict=True)
                    if k not in self.known]
            self.counters.add("blocks:save_skipped", full - r.known - len(todo))
            r.known = full
            if todo:
                meta.saves.append(SaveSpec([k for k, _ in todo], [b for _, b in todo]))
                self.known.add([k for k, _ in todo])
        return meta

    def finished(self, req_id: str) -> None:
        """vLLM's ``request_finished``: forget the request (its blocks were saved as they filled)."""
        self._reqs.pop(req_id, None)

    def load_done(self, req_id: str) -> None:
        self._inflight.pop(req_id, None)
        r = self._reqs.get(req_id)
        if r is not None:
            r.loading = False

    def report(self, worker: TierKVWorkerMetadata | None) -> None:
        """vLLM's ``update_connector_output``: the worker's measurements of the last step(s)."""
        if worker is None:
            return
        for seqs, seconds in worker.steps:
            self.calibrator.observe(seqs, seconds)
        for o in worker.loads:
            self.load_done(o.req_id)
            if o.loaded:
                self.cost.observe(o.tiers[: o.loaded], o.seconds)
            if o.loaded < o.wanted:
                self._fell_short(o.req_id, o.loaded, o.bad_keys)

    def _fell_short(self, req_id: str, loaded: int, bad: Sequence[bytes]) -> None:
        """A load stopped after ``loaded`` blocks: vLLM recomputes the rest, and the rest is not
        known to be held any more (missing, corrupt and deleted, or unread), so it is saved again
        once recomputed."""
        self.known.discard(bad)
        r = self._reqs.get(req_id)
        if r is None or loaded >= len(r.load_keys):
            return
        # vLLM asks again for the request it reschedules: answering from the cache would load the
        # same blocks again (missing or deleted now), fail again, and never let it run
        r.failed, r.answer, r.plan = True, None, None
        rest = r.load_keys[loaded:]
        self.known.discard(rest)
        first = r.keys.keys.index(rest[0]) if rest[0] in r.keys.keys else r.known
        r.known = min(r.known, first)
