"""What the daemon maps is a segment it may write, handed over by the process that owns it.

Segments reach the daemon only as file descriptors on its unix socket, with a ticket from an
authenticated AttachShm. Each check on what is handed over is tried with the thing it refuses,
through the real socket of an in-process daemon: a symlink, a directory, a file on disk, a memfd
whose size could still change or whose pages were never reserved, one of another size or
another user; tickets that are unknown, spent or for another size; connections that never say
hello, carry two descriptors, or talk after their hello. And shared memory needs nothing of
/dev/shm: a full one changes nothing.
"""

from __future__ import annotations

import mmap
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvstore.client import shm_link
from kvstore.client.shm import HEADER_BYTES, ShmSegment
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.shm_listener import ShmListener
from kvstore.server.shm_sessions import ShmSessions
from tests.fixtures_kvstore import WAIT_S, block, connect, fetch_one, inprocess_daemon
from tiers.memfd import memfd, reserve, seal_size

SIZE = HEADER_BYTES + (1 << 20)
ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def listening(tmp_path: Path, **kw: float) -> Iterator[tuple[ShmSessions, ShmListener]]:
    sessions = ShmSessions()
    listener = ShmListener(sessions, tmp_path / "shm.sock", **kw)  # type: ignore[arg-type]
    listener.start()
    try:
        yield sessions, listener
    finally:
        listener.close()
        sessions.close()


def _hand_over(sessions: ShmSessions, fd: int, size: int = SIZE,
               announced: int = SIZE) -> tuple[pb.ShmWelcome, socket.socket]:  # fmt: skip
    """The daemon's answer, and the connection that keeps the session (the caller closes it)."""
    ticket = sessions.ticket(announced)
    conn, welcome, arena = shm_link.join(sessions.socket_path, ticket, fd, size, WAIT_S)
    assert arena is None
    return welcome, conn


def _good_memfd(size: int = SIZE, *, sealed: bool = True, reserved: bool = True) -> int:
    fd = memfd("tierkv-seg-test", size)
    mem = mmap.mmap(fd, size)
    if reserved:
        reserve(fd, mem)
    mem.close()
    if sealed:
        seal_size(fd)
    return fd


def test_a_sealed_reserved_memfd_is_taken(tmp_path: Path) -> None:
    with listening(tmp_path) as (sessions, _):
        fd = _good_memfd()
        try:
            welcome, conn = _hand_over(sessions, fd)
            assert welcome.ok and welcome.session and len(sessions) == 1
            conn.close()
        finally:
            os.close(fd)


def _refusal(sessions: ShmSessions, fd: int, **kw: int) -> str:
    try:
        welcome, conn = _hand_over(sessions, fd, **kw)
        conn.close()
    finally:
        os.close(fd)
    assert not welcome.ok and len(sessions) == 0 and sessions.mapped_bytes == 0
    assert "\n" not in welcome.reason and welcome.reason
    return welcome.reason


def test_a_symlink_is_refused_with_one_line(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"\0" * SIZE)
    (tmp_path / "link").symlink_to(target)
    with listening(tmp_path) as (sessions, _):
        fd = os.open(tmp_path / "link", os.O_PATH | os.O_NOFOLLOW)
        assert "not a regular file" in _refusal(sessions, fd)
        fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
        assert "not a regular file" in _refusal(sessions, fd)


def test_a_file_on_disk_is_refused(tmp_path: Path) -> None:
    """A regular file of the right size, owner and mode, every byte written: but its size can
    change under the daemon's mapping (a truncate, and the daemon's next write is a SIGBUS)."""
    path = tmp_path / "plain"
    path.write_bytes(b"\0" * SIZE)
    with listening(tmp_path) as (sessions, _):
        assert "sealed" in _refusal(sessions, os.open(path, os.O_RDWR))


def test_an_unsealed_or_unreserved_memfd_is_refused(tmp_path: Path) -> None:
    with listening(tmp_path) as (sessions, _):
        assert "sealed" in _refusal(sessions, _good_memfd(sealed=False))
        assert "reserved" in _refusal(sessions, _good_memfd(reserved=False))


def test_size_owner_and_mode_are_checked(tmp_path: Path) -> None:
    with listening(tmp_path) as (sessions, _):
        assert "segment size" in _refusal(sessions, _good_memfd(SIZE + 4096))  # not the size it says it is
        assert "AttachShm announced" in _refusal(sessions, _good_memfd(), announced=SIZE + 4096)
        fd = _good_memfd()
        ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
        os.close(fd)
        assert "read-write" in _refusal(sessions, ro)
        if os.getuid() == 0:  # only root can give a file away
            fd = _good_memfd()
            os.fchown(fd, 65534, 65534)
            assert "uid 65534" in _refusal(sessions, fd)


def test_tickets_are_single_use_and_required(tmp_path: Path) -> None:
    with listening(tmp_path) as (sessions, _):
        fd = _good_memfd()
        try:
            ticket = sessions.ticket(SIZE)
            conn, welcome, _ = shm_link.join(sessions.socket_path, ticket, fd, SIZE, WAIT_S)
            assert welcome.ok
            again, second, _ = shm_link.join(sessions.socket_path, ticket, fd, SIZE, WAIT_S)
            assert not second.ok and "ticket" in second.reason
            forged, third, _ = shm_link.join(sessions.socket_path, b"\0" * 16, fd, SIZE, WAIT_S)
            assert not third.ok and "ticket" in third.reason
            assert len(sessions) == 1
            for c in (conn, again, forged):
                c.close()
        finally:
            os.close(fd)
        sessions.ticket_s = 1e-9
        fd = _good_memfd()
        assert "expired" in _refusal(sessions, fd)


def test_a_connection_that_never_says_hello_is_closed(tmp_path: Path) -> None:
    with listening(tmp_path, hello_s=0.2) as (sessions, _):
        mute = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        mute.settimeout(WAIT_S)
        mute.connect(sessions.socket_path)
        assert mute.recv(64) == b"", "the daemon kept a silent connection open"
        mute.close()


def test_two_descriptors_or_talk_after_hello_end_it(tmp_path: Path) -> None:
    with listening(tmp_path) as (sessions, _):
        fd, other = _good_memfd(), _good_memfd()
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            conn.connect(sessions.socket_path)
            hello = pb.ShmHello(ticket=sessions.ticket(SIZE), size=SIZE).SerializeToString()
            socket.send_fds(conn, [hello], [fd, other])
            reply = pb.ShmWelcome.FromString(conn.recv(4096))
            assert not reply.ok and "one descriptor" in reply.reason and len(sessions) == 0
            conn.close()
            conn, welcome, _ = shm_link.join(sessions.socket_path, sessions.ticket(SIZE), fd, SIZE, WAIT_S)
            assert welcome.ok and len(sessions) == 1
            conn.send(b"more")  # nothing may follow the hello
            conn.settimeout(WAIT_S)
            try:
                got = conn.recv(64)
            except ConnectionResetError:  # closed by the daemon with "more" unread
                got = b""
            assert got == b"", "the daemon answered talk after the hello"
            deadline = time.monotonic() + WAIT_S
            while len(sessions) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert len(sessions) == 0
            conn.close()
        finally:
            os.close(fd)
            os.close(other)


def test_a_live_socket_is_not_taken_over_and_a_stale_one_is(tmp_path: Path) -> None:
    from tiers.errors import ConfigError

    with listening(tmp_path) as (sessions, _):
        with pytest.raises(ConfigError, match="in use"):
            ShmListener(ShmSessions(), sessions.socket_path)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(str(tmp_path / "shm.sock"))
    stale.close()  # a daemon that died: its file is left, nobody listens
    with listening(tmp_path) as (sessions, _):
        fd = _good_memfd()
        try:
            welcome, conn = _hand_over(sessions, fd)
            assert welcome.ok
            conn.close()
        finally:
            os.close(fd)
    (tmp_path / "shm.sock").write_text("not a socket")
    with pytest.raises(ConfigError, match="not a socket"):
        ShmListener(ShmSessions(), tmp_path / "shm.sock")


def test_a_long_socket_path_works(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    with listening(deep) as (sessions, _):
        assert len(sessions.socket_path) > 108
        fd = _good_memfd()
        try:
            welcome, conn = _hand_over(sessions, fd)
            assert welcome.ok
            conn.close()
        finally:
            os.close(fd)


def test_client_segments_are_reserved_and_sealed() -> None:
    seg = ShmSegment.create(1 << 20)
    try:
        assert seg.fd is not None
        st = os.fstat(seg.fd)
        assert st.st_blocks * 512 >= seg.size
        with pytest.raises(PermissionError):
            os.ftruncate(seg.fd, 4096)
    finally:
        seg.close()


SMALL_DEV_SHM = """
import subprocess, sys
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", "/dev/shm"], check=True)
from kvstore.client.client import KVStoreClient
from tests.fixtures_kvstore import block, connect, fetch, inprocess_daemon
with inprocess_daemon() as d, connect(d, use_shm=True, shm_bytes=8 << 20) as c:
    items = [block(f"full-{i}", float(i)) for i in range(32)]  # 2 MiB: far more than /dev/shm holds
    assert c.put_many(items) == [True] * 32
    assert fetch(c, [k for k, _ in items]) == [v for _, v in items]
    assert len(d.sessions) == 1
print("ok", flush=True)
"""


@pytest.mark.skipif(shutil.which("unshare") is None or os.getuid() != 0, reason="needs root to mount a small /dev/shm")
def test_a_full_dev_shm_changes_nothing() -> None:
    """In a mount namespace of its own, /dev/shm is a 64 KiB tmpfs: segments and the arena are
    memfds, so a daemon and a client still move 2 MiB through shared memory (files in /dev/shm:
    the first write past 64 KiB was a SIGBUS)."""
    res = subprocess.run(["unshare", "--mount", sys.executable, "-c", SMALL_DEV_SHM], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)  # fmt: skip
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


NO_ROOM = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # no file (memfd included) past 1 MiB
from kvstore.errors import KVStoreError
from tests.fixtures_kvstore import block, connect, fetch_one, inprocess_daemon
with inprocess_daemon() as d:
    k, v = block("no-room", 4.0)
    with connect(d, shm_bytes=8 << 20) as c:
        c.put(k, v)
        assert fetch_one(c, k) == v and not c._shm.enabled and len(d.sessions) == 0
    with connect(d, use_shm=True, shm_bytes=8 << 20) as c:
        try:
            c.put(k, v)
        except KVStoreError as e:
            assert "no shared-memory segment" in str(e)
            print("ok", flush=True)
"""


def test_a_segment_that_cannot_be_made_means_streaming() -> None:
    """The segment's memory is refused when it is made (here by RLIMIT_FSIZE): the client
    streams, or, told to use shared memory, says why, in one line."""
    res = subprocess.run([sys.executable, "-c", NO_ROOM], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)  # fmt: skip
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_the_daemon_round_trips_through_a_handed_over_segment() -> None:
    with inprocess_daemon() as d, connect(d, use_shm=True) as c:
        k, v = block("handed", 2.0)
        assert c.put(k, v) and fetch_one(c, k) == v and len(d.sessions) == 1
