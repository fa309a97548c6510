"""The daemon's shared memory stays bounded: a dead client's segments are reclaimed, attaches
beyond the byte bound are refused (the client streams), and a session dropped in the middle of a
call gives a clean retry with the right bytes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.client.shm import HEADER_BYTES, SHM_DIR, ShmSegment
from kvstore.errors import ShmSessionLost
from kvstore.server.shm_sessions import ShmSessions
from tests.fixtures_kvstore import WAIT_S, Daemon, block, connect, each, fetch_one, inprocess_daemon
from tiers.errors import ConfigError

SEG = 1 << 20  # client segment data bytes in these tests

CLIENT = """
import sys, time
from kvstore.client.client import KVStoreClient
from kvstore.errors import ShmSessionLost
from tests.fixtures_kvstore import block, fetch_one
clients = [KVStoreClient(sys.argv[1], use_shm=True, shm_bytes=1 << 20) for _ in range(2)]
for i, c in enumerate(clients):
    k, v = block(f"dead-{i}", float(i))
    c.put(k, v)
    assert fetch_one(c, k) == v
print(" ".join(seg.name for c in clients for seg, _ in c._shm._free), flush=True)
time.sleep(600)
"""


def _mapped(pid: int, names: list[str]) -> list[str]:
    """Which of the segments ``names`` process ``pid`` still maps."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return [n for n in names if f"/dev/shm/{n}" in maps]


def test_killed_client_segments_are_reclaimed(tmp_path: Path) -> None:
    d = Daemon(tmp_path, "--cpu", "16MiB").start()
    try:
        assert d.proc is not None
        client = subprocess.Popen([sys.executable, "-c", CLIENT, d.address], stdout=subprocess.PIPE, text=True,
                                  cwd=Path(__file__).resolve().parents[2])  # fmt: skip
        try:
            assert client.stdout is not None
            names = client.stdout.readline().split()
            assert len(names) == 2 and _mapped(d.proc.pid, names) == names
        finally:
            client.send_signal(signal.SIGKILL)
            client.wait(timeout=WAIT_S)
        deadline = time.monotonic() + WAIT_S  # the daemon checks its clients every 2 s
        while _mapped(d.proc.pid, names) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _mapped(d.proc.pid, names) == [], "a dead client's segments are still mapped by the daemon"
        assert not [n for n in names if (SHM_DIR / n).exists()]  # and nothing left in /dev/shm
    finally:
        d.stop()


def _attach(sessions: ShmSessions, pid: int) -> tuple[str, ShmSegment]:
    seg = ShmSegment.create(SEG)
    try:
        return sessions.attach(seg.name, seg.size, seg.token, pid), seg
    finally:
        seg.unlink()


def test_dead_pid_is_reaped_at_the_next_attach() -> None:
    sessions = ShmSessions(reap_interval_s=3600)  # only attach reaps here
    held: list[ShmSegment] = []
    try:
        child = subprocess.Popen(["sleep", "600"])
        sid, seg = _attach(sessions, child.pid)
        held.append(seg)
        child.kill()
        child.wait()
        _, seg = _attach(sessions, os.getpid())
        held.append(seg)
        assert len(sessions) == 1 and sessions.mapped_bytes == seg.size
        with pytest.raises(ShmSessionLost, match="attach again"):
            with sessions.use(sid):
                pass
        # a pid reused by another process does not keep a dead client's session: start time differs
        sid2 = next(iter(sessions._sessions))
        sessions._sessions[sid2].started += 1
        assert sessions.reap() == 1 and sessions.mapped_bytes == 0
    finally:
        sessions.close()
        for s in held:
            s.close()


def test_dropped_session_stays_mapped_until_its_call_ends() -> None:
    sessions = ShmSessions()
    sid, seg = _attach(sessions, os.getpid())
    try:
        with sessions.use(sid) as sess:
            sessions.detach(sid)  # e.g. the client abandoned it while this call still runs
            assert sess.lost and sessions.mapped_bytes == seg.size
            sess.seg.buf[HEADER_BYTES : HEADER_BYTES + 4] = b"late"  # still mapped: no crash
        assert sessions.mapped_bytes == 0 and len(sessions) == 0
    finally:
        sessions.close()
        seg.close()


def test_byte_bound_refuses_attach_and_client_streams() -> None:
    with pytest.raises(ConfigError, match="shared-memory bound"):
        ShmSessions(max_bytes=0)
    limit = 2 * (HEADER_BYTES + SEG)
    with inprocess_daemon(ShmSessions(max_bytes=limit)) as d:
        k, v = block("bounded", 5.0)
        clients = [connect(d, shm_bytes=SEG) for _ in range(3)]
        try:
            clients[0].put(k, v)
            for c in clients:
                assert fetch_one(c, k) == v
            assert d.sessions.mapped_bytes <= limit and len(d.sessions) == 2  # the third streams
            clients[0].close()  # detaches: room for another client
            assert len(d.sessions) == 1
            late = connect(d, shm_bytes=SEG)
            clients.append(late)
            assert fetch_one(late, k) == v and len(d.sessions) == 2  # the late one attached
            clients[2].close()  # it streamed: no session of its own to drop
            assert len(d.sessions) == 2
        finally:
            for c in clients:
                c.close()


def test_session_evicted_mid_get_retries_cleanly() -> None:
    """Another client attaching takes the only session slot while our Get is writing into our
    segment: the Get fails with ShmSessionLost inside the client, which attaches again and
    returns the right bytes."""
    with inprocess_daemon(ShmSessions(max_sessions=1)) as d:
        k, v = block("evicted", 9.0)
        extra: list[ShmSegment] = []

        def evict(key: bytes) -> None:
            if key == k and not extra:
                extra.append(_attach(d.sessions, os.getpid())[1])  # evicts the session in use

        with connect(d, use_shm=True) as c:
            c.put(k, v)
            d.store.on_read = evict
            got: list[bytes] = []
            assert c.read_batches([k], each(lambda i, mv: got.append(bytes(mv)))) == [True]
            assert got == [v]
            assert d.store.reads[k] == 2  # the first try was refused, the retry served it
        for s in extra:
            s.close()
