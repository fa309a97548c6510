"""Loads run off the engine thread: a request waits in LOADING while everyone else steps on.

The daemon is real (in-process, cpu tier), the engine is the tiny Llama, and the slow load is a
test double of the loader's throttle holding one chunk on an Event (tests/connector/async_support.py),
so every test is deterministic: no timing is asserted, only what happened while the load was held.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from connector import fetch as fetch_module
from connector.state import kv_state
from engine.request import Status
from engine.sampling import SamplingParams
from tests.connector.async_support import DAEMON_FLAGS, PS, HeldLoader, in_daemon_only
from tests.connector.support import attach, detach, prompt, run
from tests.fixtures_engine import make_engine
from tests.fixtures_kvstore import served

pytestmark = pytest.mark.timeout(300)
B_IDS = prompt(120, seed=41)  # 7 loadable pages + the tail page


def _add(eng, ids: list[int], max_tokens: int = 6):
    rid = eng.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return eng.requests[rid]


def test_prefetch_starts_at_queue_time(tiny, tmp_path: Path) -> None:
    with served(tmp_path, *DAEMON_FLAGS) as d:
        eng = make_engine(tiny)
        conn = attach(eng, d.address)
        try:
            want = in_daemon_only(eng, conn, B_IDS)
            before = conn.metrics.value("tierkv_connector_lookups_total", result="hit")
            req = _add(eng, B_IDS)
            assert req.status is Status.LOADING and kv_state(req).fetch is not None  # before any step
            assert eng.wake.wait(30)  # the lookup ran on the worker with no step taken
            assert conn.metrics.value("tierkv_connector_lookups_total", result="hit") == before + 1
            while not req.finished:
                eng.step()
            assert req.output_ids == want and req.cached_tokens == 7 * PS
        finally:
            detach(eng)


def test_known_pages_are_taken_at_queue_time_and_the_transfer_follows_the_lookup(tiny, tmp_path: Path) -> None:
    """Keys the connector knows the daemon holds (it sent them) get their pages when the request is
    queued: the transfer starts with no engine step at all. Unknown keys wait for a step's poll."""
    with served(tmp_path, *DAEMON_FLAGS) as d:
        eng = make_engine(tiny)
        conn = attach(eng, d.address, load_deadline_min_s=600.0)
        try:
            want = in_daemon_only(eng, conn, B_IDS)
            held = conn.loader = HeldLoader(conn.loader, at=0)
            req = _add(eng, B_IDS)
            assert len(kv_state(req).fetch.pages) == 7
            assert held.entered.wait(30)  # lookup, then transfer: no step taken
            held.gate.set()
            while not req.finished:
                eng.step()
            assert req.output_ids == want and req.cached_tokens == 7 * PS
            eng.radix.reset()
            conn.known.discard(conn.keyspace.keys(B_IDS, None))
            held = conn.loader = HeldLoader(conn.loader, at=0)
            req = _add(eng, B_IDS)
            assert kv_state(req).fetch.pages == []
            assert eng.wake.wait(30)  # the lookup is done; its pages are taken in the next step's poll
            assert not held.entered.is_set()
            while not held.entered.is_set():
                eng.step()
            held.gate.set()
            while not req.finished:
                eng.step()
            assert req.output_ids == want and req.cached_tokens == 7 * PS
        finally:
            detach(eng)


def test_a_held_load_does_not_delay_another_requests_decode_steps(tiny, tmp_path: Path) -> None:
    other = prompt(40, seed=42)
    with served(tmp_path, *DAEMON_FLAGS) as d:
        eng = make_engine(tiny)
        conn = attach(eng, d.address, load_deadline_min_s=600.0)  # held, never timed out
        try:
            want = in_daemon_only(eng, conn, B_IDS)
            want_other = run(eng, other, max_tokens=12).output_ids
            eng.radix.reset()
            held = conn.loader = HeldLoader(conn.loader, at=2)
            b = _add(eng, B_IDS)
            while not held.entered.is_set():  # b's transfer is on the worker, two pages in
                eng.step()
            a = _add(eng, other, max_tokens=12)
            steps = tokens = 0
            while not a.finished:
                tokens += sum(o.rid == a.rid for o in eng.step())
                steps += 1
            # all of a ran while b's load was held: its own lookup (one idle step at most), its
            # prefill, then one token per step
            assert a.output_ids == want_other and tokens == 12 and steps <= 13
            assert b.status is Status.LOADING and not held.gate.is_set()
            held.gate.set()
            while not b.finished:
                eng.step()
            assert b.output_ids == want and b.cached_tokens == 7 * PS
        finally:
            detach(eng)


def test_a_load_past_its_deadline_recomputes_the_rest_identically(tiny, tmp_path: Path) -> None:
    with served(tmp_path, *DAEMON_FLAGS) as d:
        eng = make_engine(tiny)
        conn = attach(eng, d.address, load_deadline_min_s=0.5, load_deadline_factor=1.0)
        try:
            want = in_daemon_only(eng, conn, B_IDS)
            held = conn.loader = HeldLoader(conn.loader, at=2)  # never released: the deadline passes
            got = run(eng, B_IDS)
            assert held.entered.is_set() and not held.gate.is_set()
            assert got.output_ids == want
            assert got.cached_tokens == 2 * PS  # the contiguous prefix that arrived is kept
            assert conn.metrics.value("tierkv_connector_load_failures_total", reason="deadline") == 1
            eng.pool.allocator.check_integrity()
            eng.radix.check_integrity()
        finally:
            detach(eng)


def test_an_aborted_load_leaks_no_page_and_writes_into_no_page_of_anyone_else(tiny, tmp_path: Path) -> None:
    other = prompt(100, seed=43)
    with served(tmp_path, *DAEMON_FLAGS) as d:
        eng = make_engine(tiny, num_pages=32)
        conn = attach(eng, d.address, load_deadline_min_s=600.0)  # held, never timed out
        alloc = eng.pool.allocator
        try:
            in_daemon_only(eng, conn, B_IDS)
            want_other = run(eng, other).output_ids
            eng.radix.reset()
            assert alloc.num_free() == alloc.num_pages
            held = conn.loader = HeldLoader(conn.loader, at=3)
            b = _add(eng, B_IDS)
            while not held.entered.is_set():
                eng.step()
            load_pages = list(kv_state(b).fetch.pages)
            eng.abort(b.rid)
            assert b.finished and all(alloc.refcount(p) == 1 for p in load_pages)  # still the worker's
            c = run(eng, other)  # takes pages while the aborted load is still writing
            assert c.output_ids == want_other
            m = eng.radix.match_prefix(other, record_stats=False)
            assert not set(m.pages) & set(load_pages)
            kv_before = eng.pool.read_pages(m.pages).clone()
            held.gate.set()  # the late writes land: in the aborted load's own pages only
            while eng.scheduler.admitter.draining:
                eng.step()
            assert torch.equal(eng.pool.read_pages(m.pages), kv_before)
            eng.radix.reset()
            assert alloc.num_free() == alloc.num_pages  # nothing leaked
            alloc.check_integrity()
        finally:
            detach(eng)


def test_many_queued_loads_on_a_small_pool_all_finish_identically(tiny, tmp_path: Path) -> None:
    """Six requests whose prefixes only the daemon holds, queued at once on a pool that holds two:
    queued requests hold loaded prefixes, give them back when pages run short, and all finish."""
    prompts = [prompt(120, seed=50 + i) for i in range(6)]
    with served(tmp_path, *DAEMON_FLAGS) as d:
        eng = make_engine(tiny, num_pages=20)
        conn = attach(eng, d.address)
        try:
            wants = [in_daemon_only(eng, conn, ids) for ids in prompts]
            reqs = [_add(eng, ids) for ids in prompts]
            for _ in range(2000):
                if all(r.finished for r in reqs):
                    break
                eng.step()
            assert [r.output_ids for r in reqs] == wants
            assert sum(r.cached_tokens for r in reqs) > 0
            eng.radix.reset()
            assert eng.pool.allocator.num_free() == eng.pool.num_pages
            eng.pool.allocator.check_integrity()
        finally:
            detach(eng)


def test_queued_requests_give_their_loaded_prefix_back_when_a_decode_needs_pages(tiny, tmp_path: Path) -> None:
    """One seat: a long decode runs while two loaded requests wait holding 14 of the 20 pages. When
    the decode needs more, the newest queued request gives its prefix back (without that the decode
    preempts itself and waits behind pages nobody will free); everyone finishes as a plain run does."""
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    long_ids, queued = prompt(40, seed=60), [prompt(120, seed=61), prompt(120, seed=62)]
    with served(tmp_path, *DAEMON_FLAGS) as d:
        eng = LLMEngine(EngineConfig(num_pages=20, page_size=PS, max_num_seqs=1), loaded=tiny)
        conn = attach(eng, d.address)
        try:
            wants = [in_daemon_only(eng, conn, ids) for ids in queued]
            want_long = run(eng, long_ids, max_tokens=200).output_ids
            eng.radix.reset()
            a = _add(eng, long_ids, max_tokens=200)
            while a.status is not Status.RUNNING:
                eng.step()
            bs = [_add(eng, ids) for ids in queued]
            while not all(b.status is Status.WAITING and b.num_computed == 7 * PS for b in bs):
                eng.step()  # both loaded while a decodes: they hold their prefixes, a holds the seat
            for _ in range(5000):
                if a.finished and all(b.finished for b in bs):
                    break
                eng.step()
            assert a.output_ids == want_long and [b.output_ids for b in bs] == wants
            assert eng.scheduler.num_preemptions == 0
            for b in bs:  # loaded once and kept, or given back and matched again: counted as loaded
                assert b.usage.loaded == b.cached_tokens == 7 * PS and b.usage.loaded_tier == "cpu"
                assert {(p.reason, p.tier): p.pages for p in b.usage.pages} == {("loaded", "cpu"): 7, ("tail", None): 1}
            eng.radix.reset()
            assert eng.pool.allocator.num_free() == eng.pool.num_pages
            eng.pool.allocator.check_integrity()
        finally:
            detach(eng)


class _Clock:
    """connector/fetch.py's clock, moved on by the test: a deadline passes without a sleep."""

    def __init__(self) -> None:
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset


def test_a_load_the_pool_cannot_hold_by_its_deadline_loads_the_prefix_that_fits(tiny, tmp_path: Path,
                                                                                  monkeypatch) -> None:  # fmt: skip
    """A decode holds 9 of 12 pages while a 7-page load waits for pages past its deadline: the 2
    pages the pool gives then (3 free, one kept for the running decode) are loaded and only the
    rest is recomputed. Before, the whole load was given up and every page recomputed, in the very
    pages the load had waited for."""
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    clock = _Clock()
    monkeypatch.setattr(fetch_module, "time", clock)
    long_ids = prompt(128, seed=63)
    with served(tmp_path, *DAEMON_FLAGS) as d:
        eng = LLMEngine(EngineConfig(num_pages=12, page_size=PS, max_num_seqs=2), loaded=tiny)
        conn = attach(eng, d.address)
        try:
            want = in_daemon_only(eng, conn, B_IDS)
            want_long = run(eng, long_ids, max_tokens=15).output_ids
            eng.radix.reset()
            a = _add(eng, long_ids, max_tokens=15)
            while a.num_computed <= len(long_ids):
                eng.step()  # a decodes, holding 9 pages
            b = _add(eng, B_IDS)
            assert eng.wake.wait(30)  # b's lookup and decision are done
            eng.step()
            assert b.status is Status.LOADING and kv_state(b).fetch.pages == []  # the pool is short
            clock.offset += 3600.0  # past b's deadline, with a still decoding
            while not (a.finished and b.finished):
                eng.step()
            assert a.output_ids == want_long and b.output_ids == want
            assert b.cached_tokens == 2 * PS and b.usage.loaded == 2 * PS
            assert {(p.reason, p.tier): p.pages for p in b.usage.pages} == {
                ("loaded", "cpu"): 2, ("read_failed", "cpu"): 5, ("tail", None): 1}
            assert conn.metrics.value("tierkv_connector_load_failures_total", reason="no_pages") == 1
            eng.radix.reset()
            assert eng.pool.allocator.num_free() == eng.pool.num_pages
            eng.pool.allocator.check_integrity()
        finally:
            detach(eng)


def test_a_connector_closed_with_loads_queued_hands_their_pages_back(tiny, tmp_path: Path) -> None:
    """Shutdown drops the transfers still queued (the executor cancels them): their requests'
    polls report done with the untouched pages, and both requests finish as plain runs do."""
    import threading

    other = prompt(120, seed=44)
    with served(tmp_path, *DAEMON_FLAGS) as d:
        eng = make_engine(tiny)
        conn = attach(eng, d.address, load_deadline_min_s=600.0)
        try:
            want_a = in_daemon_only(eng, conn, B_IDS)
            want_b = in_daemon_only(eng, conn, other)
            held = conn.loader = HeldLoader(conn.loader, at=1)
            a = _add(eng, B_IDS)
            assert held.entered.wait(30)
            b = _add(eng, other)  # known pages: its transfer is queued behind a's by its lookup
            closing = threading.Thread(target=conn.close)
            for _ in range(3000):
                if kv_state(b).fetch.next is not None:
                    break
                threading.Event().wait(0.01)
            closing.start()  # cancels b's queued transfer, then waits for a's
            for _ in range(3000):
                if kv_state(b).fetch.next.cancelled():
                    break
                threading.Event().wait(0.01)
            held.gate.set()
            closing.join(60)
            while not (a.finished and b.finished):
                eng.step()
            assert a.output_ids == want_a and a.cached_tokens == 7 * PS
            assert b.output_ids == want_b and b.cached_tokens == 0
            eng.radix.reset()
            assert eng.pool.allocator.num_free() == eng.pool.num_pages
        finally:
            eng.hooks = []


def test_loading_hooks_must_come_before_plain_hooks(tiny, tmp_path: Path) -> None:
    class Plain:
        def propose(self, req, pages):
            return None

        def on_finish(self, req):
            pass

        def close(self):
            pass

    with served(tmp_path, *DAEMON_FLAGS) as d:
        eng = make_engine(tiny)
        conn = attach(eng, d.address)
        try:
            eng.hooks = [conn, Plain()]
            with pytest.raises(ValueError, match="loading hooks must come before"):
                eng.hooks = [Plain(), conn]
        finally:
            detach(eng)
