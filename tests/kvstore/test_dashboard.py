"""/dashboard on the daemon's HTTP port: its JSON, and the page in headless Chromium.

The page must load with no console error or uncaught exception, refresh itself (its numbers
change after real traffic without a reload) and draw a miss-ratio curve handed to its hook; the
test keeps a screenshot (under the test's tmp dir). The JSON is read-only and carries no secret.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest

from kvstore.block import encode_block
from kvstore.ops.dashboard import MissRatioCurve
from kvstore.server.daemon import Daemon
from kvstore.store.tier_bookkeeping import LevelOptions
from kvstore.store.tiered_store import TieredStore
from tests.fixtures_kvstore import connect, fetch, served
from tests.kvstore.dashboard_support import Browser, chromium_path
from tiers.cpu import CpuTier

pytestmark = pytest.mark.timeout(300)
FLOATS = 4096  # 16 KiB blocks


def _block(i: int) -> tuple[bytes, bytes]:
    key = b"dash-%012d" % i
    return key, encode_block(key, np.full(FLOATS, i, dtype=np.float32), layout="T")


@contextmanager
def daemon(tmp: Path, cpu_blocks: int = 4) -> Iterator[Daemon]:
    block = len(_block(0)[1])
    # --no-stream: the raw Get channel is not under test, and its stop waits out a 5 s accept() join
    with served(tmp, "--no-stream", "--metrics-listen", "127.0.0.1:0", "--cpu", str(cpu_blocks * block),
                "--disk", f"{tmp / 'disk'}:{8 * block}") as d:
        yield d


def traffic(d: Daemon, first: int, n: int) -> None:
    """Puts (the cpu tier spills to disk), reads of everything (disk hits are promoted), and
    lookups of these blocks, of the first four (evicted lately once they fell off disk) and of one
    never stored. Reads go newest first: the blocks still in the cpu tier are read before any
    promotion can push them out of it (read oldest first, each promoted block evicted the next
    one to be read, and whether that was a cpu or a disk hit depended on the spiller's timing)."""
    with connect(d) as c:
        items = [_block(i) for i in range(first, first + n)]
        c.put_many(items)
        assert d.store.flush(60)
        keys = [k for k, _ in items]
        fetch(c, keys[::-1])
        older = [_block(i)[0] for i in range(min(first, 4))]  # the first blocks: fallen off disk by now
        c.lookup(older + keys + [_block(10_000 + first)[0]])


def measured_curve(block: int) -> MissRatioCurve:
    """A real curve: one skewed access sequence replayed through a cpu-only TieredStore per size."""
    rng = np.random.default_rng(7)
    seq = np.minimum(rng.zipf(1.3, 300), 24) - 1
    sizes, ratios = [], []
    for blocks in (1, 2, 4, 8, 16, 24):
        with TieredStore([(CpuTier(blocks * block), LevelOptions())]) as s:
            for i in seq:
                k, v = _block(int(i))
                if s.get(k) is None:
                    s.put(k, v)
            t = s.stats().tiers[0]
            sizes.append(blocks * block)
            ratios.append(t.hits / (t.hits + t.misses))
    assert ratios == sorted(ratios) and ratios[0] < ratios[-1]  # LRU's curve never falls with size
    return MissRatioCurve("cpu", sizes, ratios, "LRU replay, 300 accesses")


def test_dashboard_json_metrics_and_routes(tmp_path: Path) -> None:
    with daemon(tmp_path) as d:
        base = f"http://127.0.0.1:{d.metrics_port}"
        before = httpx.get(f"{base}/dashboard.json").json()
        assert [t["name"] for t in before["tiers"]] == ["cpu", "disk"]
        assert before["lookups"]["keys"] == 0 and before["curves"] == []
        traffic(d, 0, 8)  # 8 blocks into 4: 4 spill to disk
        after = httpx.get(f"{base}/dashboard.json").json()
        cpu, disk = after["tiers"]
        assert cpu["capacity_bytes"] == before["tiers"][0]["capacity_bytes"] and cpu["used_bytes"] > 0
        assert disk["spills"] >= 4 and disk["hits"] >= 1 and disk["promotions"] >= 1 and cpu["evictions"] >= 4
        assert after["lookups"]["absent"] == 1 and after["lookups"]["keys"] == 9
        assert "engine" in after["decisions_at"]
        assert "last_error" not in httpx.get(f"{base}/dashboard.json").text  # may quote a server address
        page = httpx.get(f"{base}/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "dashboard.json" in page.text
        assert httpx.post(f"{base}/dashboard.json").status_code == 405  # read-only
        metrics = httpx.get(f"{base}/metrics").text
        assert 'tierkv_lookup_keys_total{result="absent",tier=""} 1.0' in metrics
        assert 'tierkv_tier_spills_total{tier="disk"}' in metrics

        def broken() -> list[MissRatioCurve]:
            return [MissRatioCurve("cpu", [2, 1], [0.1, 0.2])]

        d.dashboard.curves = broken  # a bad curve is reported on the page, never a failed page
        bad = httpx.get(f"{base}/dashboard.json").json()
        assert bad["curves"] == [] and "ascend" in bad["curve_error"]
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        MissRatioCurve("cpu", [1, 2], [0.5, 1.5]).check()


def test_dashboard_page_in_headless_chromium(tmp_path: Path) -> None:
    if chromium_path() is None:
        pytest.skip("chromium is not installed: scripts/system-deps.sh installs Debian's chromium")
    with daemon(tmp_path) as d:
        curve = measured_curve(len(_block(0)[1]))
        d.dashboard.curves = lambda: [curve]
        traffic(d, 0, 4)
        browser = Browser(tmp_path)
        try:
            browser.navigate(f"http://127.0.0.1:{d.metrics_port}/dashboard?refresh=300")
            browser.wait_for("Number(document.getElementById('samples').textContent) >= 2")
            row = "document.querySelector('#tiers tr[data-tier=\"%s\"] .%s').textContent"
            keys0 = browser.eval("document.getElementById('lookup-keys').textContent")
            hits0 = browser.eval(row % ("cpu", "hits"))
            assert browser.eval("document.querySelectorAll('#curve polyline').length") == 1
            traffic(d, 100, 8)  # the page is not reloaded: it must pick this up by itself
            browser.wait_for(f"document.getElementById('lookup-keys').textContent !== '{keys0}'")
            browser.wait_for(f"{row % ('cpu', 'hits')} !== '{hits0}'")
            assert int(browser.eval(row % ("cpu", "hits"))) > int(hits0)
            assert browser.eval(row % ("disk", "read-rate")) != "-"  # rates from two polls
            assert browser.eval("document.querySelector('#lookups tr[data-outcome=\"absent:\"]') !== null")
            shot = browser.screenshot(tmp_path / "dashboard.png")
            assert shot.stat().st_size > 10_000
            assert browser.errors == []
            # the check can fail: an uncaught error thrown by the page is seen
            browser.eval("window.setTimeout(() => { throw new Error('detector check') }, 0); 1")
            browser.wait_for("document.readyState === 'complete'")
            deadline = time.monotonic() + 30
            while not any("detector check" in e for e in browser.errors) and time.monotonic() < deadline:
                browser.eval("1")  # events arrive between replies
            assert any("detector check" in e for e in browser.errors), browser.errors
        finally:
            browser.close()
