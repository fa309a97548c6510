"""The daemon's shared memory stays bounded: a dead client's segments are reclaimed (by its unix
connection closing, never by a pid it claims, so in its own PID namespace too), attaches beyond
the byte bound are refused (the client streams), and a session dropped in the middle of a call
gives a clean retry with the right bytes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore.client.shm import HEADER_BYTES, ShmSegment
from kvstore.errors import ShmSessionLost
from kvstore.server.shm_sessions import ShmSessions
from tests.fixtures_kvstore import (
    WAIT_S,
    Daemon,
    block,
    connect,
    each,
    fetch_one,
    inprocess_daemon,
    segments_mapped,
)
from tiers.errors import ConfigError

SEG = 1 << 20  # client segment data bytes in these tests
ROOT = Path(__file__).resolve().parents[2]

CLIENT = """
import os, sys, time
from kvstore.client.client import KVStoreClient
from tests.fixtures_kvstore import block, fetch_one
clients = [KVStoreClient(sys.argv[1], use_shm=True, shm_bytes=1 << 20) for _ in range(2)]
for i, c in enumerate(clients):
    k, v = block(f"dead-{i}", float(i))
    c.put(k, v)
    assert fetch_one(c, k) == v
print(os.getpid(), " ".join(seg.name for c in clients for seg, _ in c._shm._free), flush=True)
time.sleep(600)
"""


def _wait_unmapped(pid: int, names: set[str]) -> set[str]:
    """The segments of ``names`` daemon ``pid`` still maps once they are gone, or WAIT_S passed."""
    deadline = time.monotonic() + WAIT_S
    while segments_mapped(pid) & names and time.monotonic() < deadline:
        time.sleep(0.1)
    return segments_mapped(pid) & names


def _run_and_kill(d: Daemon, argv: list[str]) -> tuple[int, set[str]]:
    """Start a client (``argv`` + the script), read (its pid as it sees it, its segments), check
    the daemon maps them, SIGKILL the client."""
    assert d.proc is not None
    client = subprocess.Popen([*argv, sys.executable, "-c", CLIENT, d.address], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    try:
        assert client.stdout is not None
        pid, *names = client.stdout.readline().split()
        assert len(names) == 2 and segments_mapped(d.proc.pid) >= set(names)
    finally:
        victims = [client.pid]
        children = Path(f"/proc/{client.pid}/task/{client.pid}/children")
        if argv and children.exists():  # unshare --fork: the python inside is its child
            victims += [int(p) for p in children.read_text().split()]
        for p in reversed(victims):
            os.kill(p, signal.SIGKILL)
        client.wait(timeout=WAIT_S)
    return int(pid), set(names)


def test_killed_client_segments_are_reclaimed(tmp_path: Path) -> None:
    d = Daemon(tmp_path, "--cpu", "16MiB").start()
    try:
        _, names = _run_and_kill(d, [])
        assert d.proc is not None
        assert _wait_unmapped(d.proc.pid, names) == set(), "a dead client's segments are still mapped by the daemon"
    finally:
        d.stop()


def _can_unshare_pid() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_unshare_pid(), reason="needs unshare --pid (root): a client in its own PID namespace")
def test_client_that_is_pid_1_of_its_namespace_is_reclaimed(tmp_path: Path) -> None:
    """As in the shipped compose and k8s setups: the client is PID 1 of its own PID namespace,
    a pid that in the daemon's namespace is init, alive forever. Killed, its segments still go:
    the daemon goes by the connection, which the kernel closes."""
    d = Daemon(tmp_path, "--cpu", "16MiB").start()
    try:
        pid, names = _run_and_kill(d, ["unshare", "--pid", "--fork", "--kill-child"])
        assert pid == 1, "the client was not PID 1 of its own namespace"
        assert d.proc is not None
        assert _wait_unmapped(d.proc.pid, names) == set(), "a dead PID-1 client's segments are still mapped"
    finally:
        d.stop()


def _attach(sessions: ShmSessions) -> tuple[str, ShmSegment]:
    seg = ShmSegment.create(SEG)
    assert seg.fd is not None
    return sessions.attach(seg.fd, seg.size, os.getuid()), seg


def test_the_session_ends_with_its_connection() -> None:
    """In-process: closing the segment (its link) is enough for the daemon to drop the session,
    with no RPC; a live connection keeps it."""
    with inprocess_daemon() as d:
        c = connect(d, use_shm=True)
        try:
            k, v = block("linked", 1.0)
            c.put(k, v)
            ((seg, sid),) = c._shm._free
            with d.sessions.use(sid):
                pass  # alive
            seg.close()  # no DetachShm: only the connection ends
            deadline = time.monotonic() + WAIT_S
            while (len(d.sessions) or d.sessions.mapped_bytes) and time.monotonic() < deadline:
                time.sleep(0.02)  # dropped, then unmapped
            assert len(d.sessions) == 0 and d.sessions.mapped_bytes == 0
            with pytest.raises(ShmSessionLost):
                with d.sessions.use(sid):
                    pass
        finally:
            c._shm._free.clear()
            c.close()


def test_dropped_session_stays_mapped_until_its_call_ends() -> None:
    sessions = ShmSessions()
    sid, seg = _attach(sessions)
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
                extra.append(_attach(d.sessions)[1])  # evicts the session in use

        with connect(d, use_shm=True) as c:
            c.put(k, v)
            d.store.on_read = evict
            got: list[bytes] = []
            assert c.read_batches([k], each(lambda i, mv: got.append(bytes(mv)))) == [True]
            assert got == [v]
            assert d.store.reads[k] == 2  # the first try was refused, the retry served it
        for s in extra:
            s.close()
