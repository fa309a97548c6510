"""The daemon end to end over gRPC: ``kvstore serve`` subprocesses on free loopback ports.

Covers put/get/lookup/delete/stats/health/metrics over both byte paths (shared memory and
streamed), restart after SIGKILL (disk blocks readable again), SIGTERM finishing spills, and a
client facing a daemon that is down.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from bench.servers import free_port
from kvstore.block import decode_block, encode_block
from kvstore.client.client import KVStoreClient
from kvstore.client.retry import ExponentialBackoff, Retry
from kvstore.errors import KVStoreUnavailable
from tests.fixtures_kvstore import Daemon, connect, each, fetch, fetch_one, mapped_segments

BLOCK_FLOATS = 64 * 1024  # 256 KiB of payload


def _block(i: int, floats: int = BLOCK_FLOATS) -> tuple[bytes, bytes]:
    key = b"key-%012d" % i
    return key, encode_block(key, np.full(floats, i, dtype=np.float32), layout="T")


def _wait_spilled(c: KVStoreClient) -> None:
    deadline = time.monotonic() + 20
    while c.stats().pending_blocks and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.parametrize("use_shm", [True, False])
def test_round_trip(tmp_path: Path, daemons: list[Daemon], use_shm: bool) -> None:
    mport = free_port()
    d = Daemon(tmp_path, "--cpu", "1MiB", "--disk", f"{tmp_path}/disk:64MiB", "--metrics-port", str(mport)).start()
    daemons.append(d)
    blocks = [_block(i) for i in range(10)]
    with connect(d, deadline_s=10, use_shm=use_shm) as c:
        assert c.health()
        assert c.put_many(blocks) == [True] * 10
        assert c.put_many(blocks[:3]) == [False] * 3  # idempotent
        assert d.proc is not None and (mapped_segments(d.proc.pid) > 0) is use_shm  # bytes through shm, or not
        _wait_spilled(c)
        res = c.lookup([k for k, _ in blocks] + [b"unknown-key"])
        assert res.prefix_len == 10 and res.tiers[-1] is None
        assert set(res.tiers[:10]) == {"cpu", "disk"}
        got = fetch(c, [k for k, _ in blocks] + [b"unknown-key"])
        assert got[:10] == [b for _, b in blocks] and got[10] is None
        pool = bytearray(11 * len(blocks[1][1]))
        n = len(blocks[1][1])

        def into(i: int, mv: memoryview) -> None:
            pool[i * n : (i + 1) * n] = mv

        assert c.read_batches([k for k, _ in blocks] + [b"unknown-key"], each(into)) == [True] * 10 + [False]
        assert bytes(pool[3 * n : 4 * n]) == blocks[3][1]
        blk = c.get_blocks([blocks[4][0]])[0]
        assert blk is not None and blk.array()[0] == 4 and blk.layout == "T"
        assert c.delete([blocks[0][0], b"unknown-key"]) == 1
        assert fetch_one(c, blocks[0][0]) is None
        st = {t.name: t for t in c.stats().tiers}
        assert st["cpu"].used_bytes <= st["cpu"].capacity_bytes and st["disk"].spills >= 6
        assert st["disk"].hits >= 1 and st["cpu"].misses >= 1
    text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()
    assert 'tierkv_tier_capacity_bytes{tier="cpu"} 1.048576e+06' in text
    assert 'tierkv_tier_spills_total{tier="disk"}' in text and "tierkv_tier_read_seconds_bucket" in text
    out = subprocess.run([sys.executable, "-m", "kvstore", "stats", "--address", d.address],
                         capture_output=True, text=True, timeout=30, check=True).stdout  # fmt: skip
    assert "disk" in out and "capacity" in out


def test_sigkill_restart_keeps_disk_blocks(tmp_path: Path, daemons: list[Daemon]) -> None:
    d = Daemon(tmp_path, "--cpu", "1MiB", "--disk", f"{tmp_path}/disk:64MiB").start()
    daemons.append(d)
    port = d.address.rpartition(":")[2]
    blocks = [_block(i) for i in range(12)]
    c = connect(d, deadline_s=5, retry=Retry(attempts=40, backoff=ExponentialBackoff(0.05, 0.2)))
    c.put_many(blocks)
    _wait_spilled(c)
    tiers = c.lookup([k for k, _ in blocks]).tiers
    on_disk = [i for i, t in enumerate(tiers) if t == "disk"]
    assert len(on_disk) >= 8
    assert d.kill(signal.SIGKILL) == -signal.SIGKILL
    d.start(listen=f"127.0.0.1:{port}")  # same port: the same client reconnects (new shm session)
    got = fetch(c, [blocks[i][0] for i in on_disk])
    assert got == [blocks[i][1] for i in on_disk]
    assert c.stats().tiers[1].blocks >= len(on_disk)
    c.close()


def test_sigterm_finishes_spills(tmp_path: Path, daemons: list[Daemon]) -> None:
    d = Daemon(tmp_path, "--cpu", "1MiB", "--disk", f"{tmp_path}/disk:64MiB").start()
    daemons.append(d)
    blocks = [_block(i) for i in range(24)]
    with connect(d, deadline_s=10) as c:
        c.put_many(blocks)
    assert d.kill(signal.SIGTERM) == 0  # graceful: queued spills land on disk first
    d.start()
    with connect(d, deadline_s=10) as c:
        res = c.lookup([k for k, _ in blocks])
        # everything evicted from the 1 MiB cpu tier reached the disk; only cpu contents are gone
        assert res.tiers[:20] == ["disk"] * 20
        assert decode_block(fetch_one(c, blocks[0][0]) or b"").array()[0] == 0


def test_unavailable_daemon_fails_fast() -> None:
    c = connect(f"127.0.0.1:{free_port()}", deadline_s=2, retry=Retry(attempts=3))
    t = time.monotonic()
    with pytest.raises(KVStoreUnavailable):
        c.lookup([b"k" * 16])
    with pytest.raises(KVStoreUnavailable):
        fetch(c, [b"k" * 16])
    assert time.monotonic() - t < 5
    assert not c.health()
    c.close()


def test_concurrent_clients(tmp_path: Path, daemons: list[Daemon]) -> None:
    import threading

    d = Daemon(tmp_path, "--cpu", "2MiB", "--disk", f"{tmp_path}/disk:64MiB").start()
    daemons.append(d)
    errors: list[BaseException] = []
    shared = connect(d, deadline_s=20)  # one client used by several threads too

    def worker(base: int, own: bool) -> None:
        try:
            c = connect(d, deadline_s=20) if own else shared
            blocks = [_block(base + i, floats=16 * 1024) for i in range(20)]
            for j in range(0, 20, 5):
                c.put_many(blocks[j : j + 5])
                got = fetch(c, [k for k, _ in blocks[: j + 5]])
                assert got == [b for _, b in blocks[: j + 5]]
            if own:
                c.close()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(b * 1000, b % 2 == 0)) for b in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shared.close()
    assert not errors, errors[0]


def test_a_daemon_without_shm_and_a_small_segment(tmp_path: Path, daemons: list[Daemon]) -> None:
    d = Daemon(tmp_path, "--cpu", "32MiB", "--no-shm").start()
    daemons.append(d)
    blocks = [_block(i) for i in range(12)]
    with connect(d) as c:
        c.put_many(blocks)
        assert fetch_one(c, blocks[0][0]) == blocks[0][1]  # daemon refused shm: bytes streamed
        assert d.proc is not None and mapped_segments(d.proc.pid) == 0
    d.stop()
    d = Daemon(tmp_path, "--cpu", "32MiB").start()
    daemons.append(d)
    # a 1 MiB segment holds 3 blocks (the arena off: every block comes through it): a read of 12
    # takes several rounds, each reusing the whole segment
    with connect(d, shm_bytes=1 << 20, use_arena=False) as c:
        c.put_many(blocks)
        assert fetch(c, [k for k, _ in blocks]) == [b for _, b in blocks]
        assert d.proc is not None and mapped_segments(d.proc.pid) == 1
        assert fetch(c, [k for k, _ in blocks[:3]]) == [b for _, b in blocks[:3]]
