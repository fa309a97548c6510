"""Why did it miss: every prompt page gets exactly one outcome, each reason produced for real.

An in-process daemon (real tiers: cpu, and disk where a block must be corrupted at rest), the tiny
Llama engine and the real connector. A ghost comes from a cpu tier too small for the prompt (the
evicted blocks fall off it), a read failure from a block corrupted inside the disk tier, a bypass
from a tier slowed down by the loader's bandwidth throttle until the cost model prefers recompute,
"unavailable" from a daemon address nobody listens on. In every case the outcomes add up to the
prompt's pages, and they reach the response's usage and the engine's /metrics.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from connector.attribution import DaemonView, attribute
from connector.state import kv_state
from engine.request import PageOutcome, PromptUsage, Request
from kvstore.server.daemon import Daemon
from tests.connector.support import attach, detach, prompt, run
from tests.fixtures_engine import make_engine
from tests.fixtures_kvstore import connect, served

pytestmark = pytest.mark.timeout(300)
PS = 16
N = 120  # tokens: 7 loadable pages + the tail page
LOADABLE = (N - 1) // PS
# the daemons run with --no-stream: loads go through shared memory (the raw Get channel's stop waits
# out a 5 s accept() join)


def block_bytes(tiny) -> int:
    return make_engine(tiny, num_pages=8).pool.bytes_per_page + 4096  # payload + header, rounded up


def outcomes(req: Request) -> dict[tuple[str, str | None], int]:
    u = req.usage
    assert u is not None and u.page_size == PS
    total = sum(p.pages for p in u.pages)
    assert total == -(-len(req.prompt_ids) // PS)  # every page, exactly once
    return {(p.reason, p.tier): p.pages for p in u.pages}


def offload_all(eng, conn, d: Daemon) -> None:
    eng.radix.evict(eng.pool.num_pages)
    assert conn.flush(60)
    assert d.store.flush(60)


def test_radix_loaded_absent_evicted_and_after_gap(tiny, tmp_path: Path) -> None:
    ids, other = prompt(N, seed=31), prompt(N, seed=32)
    with served(tmp_path, "--no-stream", "--cpu", str(4 * block_bytes(tiny))) as d:
        eng = make_engine(tiny)
        conn = attach(eng, d.address)
        try:
            first = run(eng, ids)
            assert outcomes(first) == {("absent", None): LOADABLE, ("tail", None): 1}
            assert outcomes(run(eng, ids)) == {("radix", None): LOADABLE, ("tail", None): 1}

            offload_all(eng, conn, d)  # 7 pages into a ~4-block cpu tier: the oldest fall off it
            cpu = d.store.stats().tiers[0]
            held = cpu.blocks
            assert cpu.evictions == LOADABLE - held >= 2
            gone = LOADABLE - held
            keys = conn.keyspace.keys(ids, None)[:LOADABLE]
            with connect(d) as c:
                res = c.lookup(keys)
            assert res.tiers == [None] * gone + ["cpu"] * held
            assert res.evicted_from == ["cpu"] * gone + [None] * held
            again = run(eng, ids)  # the first pages were evicted; the rest are held but behind the gap
            assert outcomes(again) == {("evicted", "cpu"): gone, ("after_gap", "cpu"): held, ("tail", None): 1}
            assert again.cached_tokens == 0

            eng.radix.reset()  # (reset offloads nothing: the daemon keeps its state)
            d.store.delete(keys[0])  # a delete is not an eviction: page 0 is plainly absent now
            assert outcomes(run(eng, ids)) == {("absent", None): 1, ("evicted", "cpu"): gone - 1,
                                               ("after_gap", "cpu"): held, ("tail", None): 1}

            eng.radix.reset()
            short = other[: held * PS + 1]  # as many loadable pages as the cpu tier holds: all load
            run(eng, short)
            offload_all(eng, conn, d)
            loaded = run(eng, short)
            assert outcomes(loaded) == {("loaded", "cpu"): held, ("tail", None): 1}
            assert loaded.cached_tokens == held * PS
            lookups = d.store.lookup_counts()  # the daemon saw the same story (read lookups only)
            assert lookups.evicted["cpu"] >= 2 * gone - 1 and lookups.hits["cpu"] >= 2 * held
        finally:
            detach(eng)


def test_read_failed_on_a_block_corrupted_at_rest(tiny, tmp_path: Path) -> None:
    ids = prompt(N, seed=33)
    with served(tmp_path, "--no-stream", "--cpu", str(2 * block_bytes(tiny)), "--disk", f"{tmp_path / 'disk'}:64MiB") as d:
        want = run(make_engine(tiny), ids).output_ids
        eng = make_engine(tiny)
        conn = attach(eng, d.address)  # load_mode=always: every held page is planned
        try:
            run(eng, ids)
            offload_all(eng, conn, d)
            keys = conn.keyspace.keys(ids, None)[:LOADABLE]
            (disk,) = [lv for lv in d.store.levels if lv.name == "disk"]
            bad = bytearray(bytes(disk.tier.get(keys[2])))
            bad[-100] ^= 0xFF
            disk.tier.delete(keys[2])
            disk.tier.put(keys[2], bytes(bad))
            with connect(d) as c:
                tiers = c.lookup(keys).tiers
            assert tiers[:3] == ["disk"] * 3 and None not in tiers
            got = run(eng, ids)
            assert got.output_ids == want
            want_out = {("loaded", "disk"): 2, ("tail", None): 1}
            for t in tiers[2:]:
                want_out[("read_failed", t)] = want_out.get(("read_failed", t), 0) + 1
            assert outcomes(got) == want_out
        finally:
            detach(eng)


def test_bypassed_when_a_throttled_tier_is_slower_than_recompute(tiny, tmp_path: Path) -> None:
    ids = prompt(N, seed=34)
    with served(tmp_path, "--no-stream", "--cpu", "64MiB") as d:
        eng = make_engine(tiny)
        # a fixed prefill model (0.13 s for 120 tokens); the measured side is the load
        conn = attach(eng, d.address, load_mode="auto", prefill_coeffs=(0.01, 1e-3, 0.0), load_deadline_min_s=30.0)
        try:
            run(eng, ids)
            offload_all(eng, conn, d)
            conn.loader.throttle_bps = 0.1e6  # ~0.6 s for these 7 pages of 8 KiB
            slow = run(eng, ids)  # the model still trusts its seed: it loads, and measures
            assert outcomes(slow) == {("loaded", "cpu"): LOADABLE, ("tail", None): 1}
            eng.radix.evict(eng.pool.num_pages)
            after = run(eng, ids)  # now it knows: recompute, though every page is held
            assert kv_state(after).decision.outcome == "recompute"
            assert outcomes(after) == {("bypassed", "cpu"): LOADABLE, ("tail", None): 1}
        finally:
            detach(eng)


def test_unavailable_daemon_in_the_response_and_on_metrics(tiny) -> None:
    """Through the real HTTP server: the outcomes are in usage.prompt_tokens_details.tierkv.pages
    (next to the existing keys, unchanged) and counted on the engine's /metrics."""
    from fastapi.testclient import TestClient

    from engine.async_engine import AsyncEngine
    from engine.server import create_app

    eng = make_engine(tiny)
    attach(eng, "127.0.0.1:1")  # nobody listens there
    aengine = AsyncEngine(eng)
    aengine.start()
    try:
        with TestClient(create_app(aengine, "tiny")) as http:
            body = {"prompt": prompt(N, seed=35), "max_tokens": 2, "ignore_eos": True}
            usage = http.post("/v1/completions", json=body).json()["usage"]
            short = http.post("/v1/completions", json={**body, "prompt": prompt(3, seed=36)}).json()["usage"]
            metrics = http.get("/metrics").text
    finally:
        aengine.shutdown()
        detach(eng)
    details = usage["prompt_tokens_details"]
    assert details["cached_tokens"] == 0 and details["tierkv"]["cached"]["daemon"] == 0
    assert details["tierkv"]["computed"]["prefill"] == N
    assert details["tierkv"]["pages"] == {"page_size": PS, "total": 8, "outcomes": [
        {"reason": "unavailable", "tier": None, "pages": LOADABLE}, {"reason": "tail", "tier": None, "pages": 1}]}
    assert short["prompt_tokens_details"]["tierkv"]["pages"]["outcomes"] == [
        {"reason": "tail", "tier": None, "pages": 1}]  # a prompt shorter than a page: its one page
    assert f'tierkv_engine_prompt_pages_total{{reason="unavailable",tier="none"}} {float(LOADABLE)}' in metrics
    assert 'tierkv_engine_prompt_pages_total{reason="tail",tier="none"} 2.0' in metrics


def test_attribution_is_one_outcome_per_page() -> None:
    view = DaemonView(["cpu", "disk", "disk", None, "s3", None, None], [None, None, None, "cpu", None, None, "disk"])
    got = attribute(prompt_tokens=9 * PS + 3, page_size=PS, radix_tokens=2 * PS, loaded_tokens=PS,
                    view=view, planned_pages=2)
    assert got == (PageOutcome("radix", None, 2), PageOutcome("loaded", "cpu", 1),
                   PageOutcome("read_failed", "disk", 1), PageOutcome("bypassed", "disk", 1),
                   PageOutcome("evicted", "cpu", 1), PageOutcome("after_gap", "s3", 1),
                   PageOutcome("absent", None, 1), PageOutcome("evicted", "disk", 1), PageOutcome("tail", None, 1))
    with pytest.raises(ValueError, match="add up"):  # the usage refuses outcomes that miss a page
        PromptUsage(5 * PS, page_size=PS, pages=(PageOutcome("tail", None, 1),))


def test_accounting_that_does_not_add_up_is_dropped_not_raised() -> None:
    """A usage the attribution cannot explain (radix past the last loadable page) keeps its token
    figures and loses only ``pages``: accounting never fails a request inside the engine loop."""
    from connector.state import KVState

    usage = PromptUsage(3 * PS, radix=3 * PS)
    assert KVState(page_size=PS).account(usage) == usage
    ok = KVState(page_size=PS).account(PromptUsage(3 * PS, radix=2 * PS))
    assert ok.pages == (PageOutcome("radix", None, 2), PageOutcome("tail", None, 1))


def test_ghost_lists_are_bounded_and_name_the_last_tier() -> None:
    from kvstore.store.miss_reasons import Ghosts

    g = Ghosts(["cpu", "disk"], per_tier=3)
    for i in range(5):
        g.evicted("cpu", b"k%d" % i)
    assert g.size("cpu") == 3 and g.where(b"k0") is None and g.where(b"k4") == "cpu"  # the oldest went first
    g.evicted("cpu", b"k2")  # evicted again: the newest now, so k3 is the oldest
    g.evicted("cpu", b"k5")
    assert g.where(b"k3") is None and g.where(b"k2") == "cpu"
    g.evicted("disk", b"k2")  # it spilled, then fell off disk too: disk was the last place it lived
    assert g.explain([b"k2", b"k5", b"k9"], [None, "disk", None]) == ["disk", None, None]
    g.forget(b"k2")  # deleted on purpose: no longer an eviction
    assert g.where(b"k2") is None
    g.count(["cpu", None, None], [None, "disk", None])
    assert g.counts() == ({"cpu": 1, "disk": 0}, {"cpu": 0, "disk": 1}, 1) and g.counts().keys == 3
    with pytest.raises(ValueError):
        Ghosts(["cpu"], per_tier=-1)
