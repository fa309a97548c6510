"""The daemon failing under a request: hung, killed before the load, killed in the middle of a
load, killed while the request decodes. Every request completes with the tokens a plain
recompute gives, in bounded time; failures are counted, never raised."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from connector.loader import Loader
from tests.connector.support import attach, detach, prompt, run
from tests.fixtures_engine import make_engine
from tests.fixtures_kvstore import daemon

IDS = prompt(120, seed=11)  # 7 loadable pages


def _populated(tiny, address: str, **kw: object):
    eng = make_engine(tiny)
    conn = attach(eng, address, write_through=True, lookup_deadline_s=0.2, load_deadline_min_s=0.5, **kw)
    want = run(eng, IDS).output_ids
    assert conn.flush(30)
    eng.radix.reset()
    conn.known.discard(conn.keyspace.keys(IDS, None))
    return eng, conn, want


def _wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
            return
        time.sleep(0.01)
    raise AssertionError("daemon did not stop")


def test_hung_daemon_deadline_then_recompute(tiny, tmp_path: Path) -> None:
    with daemon(tmp_path, "--cpu", "64MiB") as d:
        eng, conn, want = _populated(tiny, d.address, down_backoff_s=60.0)
        try:
            d.proc.send_signal(signal.SIGSTOP)  # alive but answering nothing
            _wait_stopped(d.proc.pid)
            t0 = time.perf_counter()
            got = run(eng, IDS)
            assert time.perf_counter() - t0 < 5
            assert got.output_ids == want and got.cached_tokens == 0
            lookups = {r: conn.metrics.value("tierkv_connector_lookups_total", result=r) for r in ("hit", "miss", "error")}
            assert lookups["error"] == 1, lookups
            eng.radix.reset()
            got = run(eng, IDS)  # inside the back-off window: the daemon is not even asked
            assert got.output_ids == want
            assert conn.metrics.value("tierkv_connector_lookups_total", result="error") == 1
        finally:
            d.proc.send_signal(signal.SIGCONT)
            detach(eng)


def test_daemon_killed_before_and_during_decode(tiny, tmp_path: Path) -> None:
    with daemon(tmp_path, "--cpu", "64MiB") as d:
        eng, conn, want = _populated(tiny, d.address)
        try:
            from engine.sampling import SamplingParams

            rid = eng.add_request(IDS, SamplingParams(max_tokens=6, ignore_eos=True))
            req = eng.requests[rid]
            while len(req.output_ids) < 2:  # loaded from the daemon (off the engine thread), prefill of the rest,
                eng.step()  # and a first decode step
            assert req.cached_tokens == 112
            d.kill()  # SIGKILL while the request decodes; its write-through will fail
            while not req.finished:
                eng.step()
            assert req.output_ids == want
            conn.known.discard(conn.keyspace.keys(IDS, None))
            eng.radix.reset()
            t0 = time.perf_counter()
            again = run(eng, IDS)  # the daemon is gone: lookups fail fast, recompute
            assert again.output_ids == want and again.cached_tokens == 0
            assert time.perf_counter() - t0 < 5
            conn.flush(30)
            assert conn.metrics.value("tierkv_connector_offload_blocks_total", result="failed") >= 1
        finally:
            detach(eng)


class _KillAfter(Loader):
    """A loader that SIGKILLs the daemon after ``n`` one-page chunks have been fetched."""

    def __init__(self, base: Loader, daemon, n: int) -> None:
        super().__init__(base.client, base.pool, base.pool.bytes_per_page,  # one page per chunk
                         in_place_chunk_bytes=base.pool.bytes_per_page)
        self.daemon, self.n, self.chunks = daemon, n, 0

    def _throttle(self, n_blocks: int, left: float) -> None:
        if self.chunks == self.n:
            self.daemon.kill()
        self.chunks += 1


def test_daemon_killed_mid_load_keeps_the_prefix_that_arrived(tiny, tmp_path: Path) -> None:
    with daemon(tmp_path, "--cpu", "64MiB") as d:
        eng, conn, want = _populated(tiny, d.address)
        try:
            conn.loader = _KillAfter(conn.loader, d, 3)
            got = run(eng, IDS)
            assert got.cached_tokens == 48  # three pages arrived before the daemon died
            assert got.output_ids == want
            assert conn.metrics.value("tierkv_connector_load_failures_total", reason="unavailable") == 1
            eng.pool.allocator.check_integrity()
            eng.radix.check_integrity()
        finally:
            detach(eng)
