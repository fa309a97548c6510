"""Same-host fast path: a shared-memory segment between one client and the daemon.

Why: over gRPC every block is framed, copied into protobuf messages and through the loopback
socket several times; through shared memory a Get is one memcpy on each side and gRPC carries
only (offset, length) handles. That is what lets the daemon beat a Redis GET by a wide margin.

A segment is a memfd (tiers/memfd.py): it has no name anyone could open, every page is reserved
when it is made (a memory shortage is an error then, and the client streams; never a SIGBUS
later), and its size is sealed, so the daemon can never be made to write past the end of a file
that shrank. The client hands the daemon its file descriptor over the daemon's unix socket
(kvstore/client/shm_link.py) and keeps that connection open: the kernel closes it when the client
dies, however it dies, and the daemon then drops the session (kvstore/server/shm_sessions.py).
Nothing depends on process ids, so containers with their own PID namespaces work alike.

The daemon checks what it is handed before mapping it (``ShmSegment.adopt``): a regular file
(not a symlink, socket or directory), of the announced size, owned by the user-id the socket's
peer credentials give, sealed against resizing, every page allocated.

Zero-copy Gets: the daemon's cpu tier keeps its blocks in a memfd (tiers/cpu.py). A client the
daemon lets read every block (an admin credential, kvstore/server/credentials.py) receives that memfd's read-only fd
at attach and maps it (``ArenaMap``): a Get of a block held there is answered with its offset
in the arena, pinned by a lease until the client has copied it out. The client can never write
there (read-only fd, and the memfd is sealed against writable mappings), and it verifies every
block it copies (copy first, verify the copy).

This module is the segment, the client's pool of them and the client's view of the arena; the
daemon's side (bounds, sessions, leases) is ``kvstore.server.shm_sessions``.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import secrets
import socket
import stat
import threading
import uuid
from collections.abc import Callable

from kvstore.errors import KVStoreError
from tiers.memfd import SIZE_SEALS, memfd, reserve, seal_size

log = logging.getLogger(__name__)
HEADER_BYTES = 4096  # reserved; data starts after it
TOKEN_BYTES = 16
SEGMENT_PREFIX = "tierkv-seg-"  # a segment's memfd name: /proc/<pid>/maps shows /memfd:<name> (deleted)


def check_segment(fd: int, size: int, uid: int) -> None:
    """Raise ValueError (one line) unless ``fd`` is a segment the daemon may map and write: a
    regular file of ``size`` bytes owned by ``uid``, sealed against resizing, every page there."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"segment is not a regular file (mode {stat.filemode(st.st_mode)}): refused")
    if st.st_size != size or size <= HEADER_BYTES:
        raise ValueError(f"segment size {st.st_size} != announced {size}")
    if st.st_uid != uid:
        raise ValueError(f"segment owned by uid {st.st_uid}, not by the caller (uid {uid})")
    if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDWR:
        raise ValueError("segment descriptor is not open read-write")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if seals & SIZE_SEALS != SIZE_SEALS:
        raise ValueError("segment is not a memfd sealed against resizing (F_SEAL_SHRINK|F_SEAL_GROW)")
    if st.st_blocks * 512 < size:
        raise ValueError(f"segment pages not reserved ({st.st_blocks * 512} of {size} bytes allocated)")


class ShmSegment:
    """A mapped segment. ``buf`` is a writable memoryview of the whole segment; ``fd`` is the
    client's descriptor until it is handed to the daemon (None after), ``link`` the connection
    that keeps the daemon's session alive (client side)."""

    def __init__(self, name: str, mem: mmap.mmap, fd: int | None) -> None:
        self.name, self.size, self.fd = name, len(mem), fd
        self._mmap = mem
        self.buf = memoryview(mem)
        self.link: socket.socket | None = None

    @classmethod
    def create(cls, size: int) -> ShmSegment:
        """Client side: a fresh segment (``size`` counts the data area), every page reserved and
        its size sealed. OSError when the memory is not there (the client streams instead)."""
        name = f"{SEGMENT_PREFIX}{uuid.uuid4().hex}"
        total = HEADER_BYTES + size
        fd = memfd(name, total)
        try:
            mem = mmap.mmap(fd, total)
            try:
                reserve(fd, mem)
                seal_size(fd)
            except BaseException:
                mem.close()
                raise
        except BaseException:
            os.close(fd)
            raise
        return cls(name, mem, fd)

    @classmethod
    def adopt(cls, fd: int, size: int, uid: int) -> ShmSegment:
        """Daemon side: map the segment a client handed over (``fd`` stays the caller's to close);
        ValueError/OSError when it is not one the daemon may write (``check_segment``)."""
        check_segment(fd, size, uid)
        return cls(f"fd-{fd}", mmap.mmap(fd, size), None)

    @property
    def data_bytes(self) -> int:
        return self.size - HEADER_BYTES

    def check_range(self, offset: int, length: int) -> None:
        if offset < HEADER_BYTES or length < 0 or offset + length > self.size:
            raise ValueError(f"range {offset}+{length} outside segment of {self.size} bytes")

    def handed_over(self) -> None:
        """The daemon has the descriptor now: ours is no longer needed (the mapping stays)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        """Unmap, and close the link: the daemon drops the session when it sees it closed."""
        self.handed_over()
        if self.link is not None:
            self.link.close()
        try:
            self.buf.release()
            self._mmap.close()
        except (BufferError, ValueError):
            pass  # a view is still exported somewhere; the mapping goes when it is dropped


class ArenaMap:
    """Client side: the daemon's cpu-tier arena, mapped read-only from the descriptor the daemon
    passed (see the module notes)."""

    def __init__(self, fd: int, size: int, token: bytes) -> None:
        """Takes ownership of ``fd`` (closed here). Raises OSError/ValueError when it is not the
        arena the daemon described (size, token)."""
        try:
            if len(token) != TOKEN_BYTES or size <= HEADER_BYTES:
                raise ValueError("bad arena description")
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                raise ValueError(f"arena descriptor is not a file of {size} bytes")
            self._mmap = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
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

    A call borrows a segment for its duration. ``attach(segment)`` hands a new segment to the
    daemon and returns the session id, or None when the daemon cannot take it (another host, its
    shared-memory bound is reached, or this client may not use shared memory): then the pool
    disables itself and the client streams bytes instead. So it does when a segment cannot be
    made (the memory is not there: a clean refusal, logged once). ``detach(session)`` tells the
    daemon to drop a session (best effort, without waiting); closing the segment's link does too.

    A call that ended in any error hands its segment to ``abandon``, never to ``release``: the
    daemon's handler may still be writing into it (the client gave up at its deadline), so it
    is never reused; the daemon unmaps it once that handler is done.
    """

    def __init__(self, size: int, attach: Callable[[ShmSegment], str | None],
                 detach: Callable[[str], None]) -> None:  # fmt: skip
        self.size = size
        self.enabled = True
        self.required = False  # a segment that cannot be made raises instead of streaming
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
        try:
            seg = ShmSegment.create(self.size)
        except OSError as e:
            if self.required:
                raise KVStoreError(f"no shared-memory segment of {self.size} bytes: {e.strerror or e}") from None
            log.warning("no shared-memory segment of %d MiB (%s): streaming instead", self.size >> 20,
                        e.strerror or e)
            self.enabled = False
            return None
        try:
            sid = self._attach(seg)
        except BaseException:
            seg.close()
            raise
        if sid is None:
            seg.close()
            self.enabled = False
            return None
        seg.handed_over()
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
