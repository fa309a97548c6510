"""Same-host fast path: a shared-memory segment between one client and the daemon.

Why: over gRPC every block is framed, copied into protobuf messages and through the loopback
socket several times; through shared memory a Get is one memcpy on each side and gRPC carries
only (offset, length) handles. That is what lets the daemon beat a Redis GET by a wide margin.

How the two sides agree (no host-name guessing): the client creates a file under /dev/shm,
writes a random token at its start and asks the daemon to attach (AttachShm). The daemon opens
the file by name and checks the token; on another host the file does not exist (or holds other
bytes) and the client falls back to streaming. Once attached, the client unlinks the file, so
nothing is left in /dev/shm if either process dies; the mapping lives until both unmap it.

Plain files + mmap rather than multiprocessing.shared_memory: the latter registers segments with
a resource tracker that unlinks (and warns about) segments the daemon merely opened.

Zero-copy Gets: the daemon's cpu tier keeps its blocks in a memfd (tiers/cpu.py). AttachShm tells
a client how to open it (/proc/<daemon pid>/fd/<fd>, checked by a token at its start), and the
client maps it read-only (``ArenaMap``): a Get of a block held there is answered with its offset
in the arena, pinned by a lease until the client has copied it out. The client can never write
there, and it verifies every block it copies (copy first, verify the copy).

This module is the segment, the client's pool of them and the client's view of the arena; the
daemon's side (bounds, reclaiming a dead client's segments, leases) is ``kvstore.server.shm_sessions``.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

SHM_DIR = Path("/dev/shm")
HEADER_BYTES = 4096  # the token lives here; data starts after it
TOKEN_BYTES = 16
_NAME_RE = re.compile(r"^tierkv-[0-9a-f]{8,64}$")


class ShmSegment:
    """A mapped /dev/shm file. ``buf`` is a writable memoryview of the whole segment."""

    def __init__(self, name: str, size: int, fd: int, owner: bool) -> None:
        self.name, self.size, self.owner = name, size, owner
        try:
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)
        self.token = bytes(self.buf[:TOKEN_BYTES])

    @classmethod
    def create(cls, size: int) -> ShmSegment:
        """Client side: a fresh segment with a random token (``size`` counts the data area)."""
        name = f"tierkv-{uuid.uuid4().hex}"
        total = HEADER_BYTES + size
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, total)
        except OSError:
            os.close(fd)
            os.unlink(SHM_DIR / name)
            raise
        seg = cls(name, total, fd, owner=True)
        seg.buf[:TOKEN_BYTES] = secrets.token_bytes(TOKEN_BYTES)
        seg.token = bytes(seg.buf[:TOKEN_BYTES])
        return seg

    @classmethod
    def open(cls, name: str, size: int, token: bytes) -> ShmSegment:
        """Daemon side: map the client's segment; raises ValueError/OSError if not ours to see."""
        if not _NAME_RE.match(name):
            raise ValueError(f"bad segment name {name!r}")
        if len(token) != TOKEN_BYTES:
            raise ValueError("bad token")
        fd = os.open(SHM_DIR / name, os.O_RDWR)
        real = os.fstat(fd).st_size
        if real != size or size <= HEADER_BYTES:
            os.close(fd)
            raise ValueError(f"segment size {real} != announced {size}")
        seg = cls(name, size, fd, owner=False)
        if not secrets.compare_digest(seg.token, token):
            seg.close()
            raise ValueError("token mismatch: not the client's segment")
        return seg

    @property
    def data_bytes(self) -> int:
        return self.size - HEADER_BYTES

    def check_range(self, offset: int, length: int) -> None:
        if offset < HEADER_BYTES or length < 0 or offset + length > self.size:
            raise ValueError(f"range {offset}+{length} outside segment of {self.size} bytes")

    def unlink(self) -> None:
        try:
            os.unlink(SHM_DIR / self.name)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        try:
            self.buf.release()
            self._mmap.close()
        except (BufferError, ValueError):
            pass  # a view is still exported somewhere; the mapping goes when it is dropped


class ArenaMap:
    """Client side: the daemon's cpu-tier arena, mapped read-only (see the module notes)."""

    def __init__(self, pid: int, fd: int, size: int, token: bytes) -> None:
        """Raises OSError/ValueError when the file cannot be opened (another host, another PID
        namespace, another user) or is not the daemon's arena (token)."""
        if len(token) != TOKEN_BYTES or size <= HEADER_BYTES:
            raise ValueError("bad arena description")
        fd_here = os.open(f"/proc/{int(pid)}/fd/{int(fd)}", os.O_RDONLY)
        try:
            if os.fstat(fd_here).st_size != size:
                raise ValueError(f"arena file is not {size} bytes")
            self._mmap = mmap.mmap(fd_here, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd_here)
        self.size, self.token = size, token
        self.buf = memoryview(self._mmap)
        if not secrets.compare_digest(bytes(self.buf[:TOKEN_BYTES]), token):
            self.close()
            raise ValueError("token mismatch: not the daemon's arena")

    def view(self, offset: int, length: int) -> memoryview:
        if offset < HEADER_BYTES or length < 0 or offset + length > self.size:
            raise ValueError(f"arena range {offset}+{length} outside {self.size} bytes")
        return self.buf[offset : offset + length]

    def close(self) -> None:
        try:
            self.buf.release()
            self._mmap.close()
        except (BufferError, ValueError):
            pass  # a view is still alive: the mapping goes when it is dropped


Handle = tuple[ShmSegment, str]  # (segment, daemon session id)


class ShmPool:
    """Client side: segments attached to one daemon, reused across calls.

    A call borrows a segment for its duration. ``attach(segment)`` asks the daemon to
    map a new segment and returns the session id, or None when the daemon cannot see it
    (another host, or its shared-memory bound is reached): then the pool disables itself and
    the client streams bytes instead. ``detach(session)`` tells the daemon to drop a session
    (best effort, without waiting).

    A call that ended in any error hands its segment to ``abandon``, never to ``release``: the
    daemon's handler may still be writing into it (the client gave up at its deadline), so it
    is never reused; the daemon unmaps it once that handler is done.
    """

    def __init__(self, size: int, attach: Callable[[ShmSegment], str | None],
                 detach: Callable[[str], None]) -> None:  # fmt: skip
        self.size = size
        self.enabled = True
        self._attach, self._detach = attach, detach
        self._closed = False
        self._free: list[Handle] = []
        self._lock = threading.Lock()

    def acquire(self) -> Handle | None:
        if not self.enabled:
            return None
        with self._lock:
            if self._free:
                return self._free.pop()
        seg: ShmSegment | None = None
        try:
            seg = ShmSegment.create(self.size)
            sid = self._attach(seg)
        except BaseException:
            if seg is not None:
                seg.close()
            raise
        finally:
            if seg is not None:
                seg.unlink()  # mapped on both sides (or refused): the name is no longer needed
        if sid is None:
            seg.close()
            self.enabled = False
            return None
        return seg, sid

    def release(self, handle: Handle) -> None:
        """The call using ``handle`` completed: the daemon is done with it, reuse it."""
        with self._lock:
            if not self._closed:
                self._free.append(handle)
                return
        self._drop([handle])

    def abandon(self, handle: Handle, stale: bool = False) -> None:
        """The call using ``handle`` failed: never reuse it. ``stale``: the daemon lost that
        session (evicted it, or restarted), so the idle ones are dropped too."""
        with self._lock:
            idle, self._free = (self._free, []) if stale else ([], self._free)
        self._drop([handle, *idle])

    def _drop(self, handles: list[Handle]) -> None:
        for seg, sid in handles:
            seg.close()
            self._detach(sid)

    def close(self) -> list[Handle]:
        """Stop reusing segments; returns the idle ones (one in use is dropped when released)."""
        with self._lock:
            self._closed = True
            out, self._free = self._free, []
        return out
