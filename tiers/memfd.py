"""Shared memory between the daemon and its same-host clients: memfds, reserved and sealed.

Why memfds and not files under /dev/shm: a memfd has no name, so nobody can open it by path
(another tenant, a symlink planted where a name was expected), and it reaches the other process
only as a file descriptor passed over a unix socket (SCM_RIGHTS, kvstore/server/shm_listener.py).
It lives on the kernel's internal tmpfs, which has no size limit of its own: a full /dev/shm
cannot touch it, and its pages are charged to the memory cgroup of whoever reserved them.

Two guards make a mapping of one safe to write into (a write to a page of a file that shrank,
or that the filesystem has no room for, is a SIGBUS, which kills a Python process):

- ``reserve``: every page is allocated when the memfd is made (populated through the mapping, so
  transparent huge pages still apply, else ``posix_fallocate``); a shortage is an OSError then, never
  a SIGBUS later.
- seals (``F_SEAL_SHRINK | F_SEAL_GROW``): its size can never change again, whoever holds it.

The cpu tier's arena goes further (``share_read_only``): after the daemon has mapped it writable,
``F_SEAL_FUTURE_WRITE`` refuses every later writable mapping and write, even through a reopened
/proc/<pid>/fd path and even to root; clients are handed a read-only descriptor, and the file's
mode drops to 0 so no other user-id can reopen it through /proc at all.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import secrets
from typing import NamedTuple

import numpy as np

log = logging.getLogger(__name__)
HUGE_PAGE = 2 * 1024 * 1024
ARENA_HEADER = 4096  # start of a shared arena's file: its token; blocks start after it
TOKEN_BYTES = 16
F_SEAL_FUTURE_WRITE = 0x0010  # Linux >= 5.1; Python's fcntl module has no name for it
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault every page in now; an error instead of a SIGBUS


class ArenaShare(NamedTuple):
    """What a client on this host needs to map the arena read-only: ``fd`` (read-only, sealed)
    is passed to it over the daemon's unix socket; the file starts with ``token``; block offsets
    count from the file's start."""

    fd: int
    size: int
    token: bytes


def memfd(name: str, size: int, hugetlb: bool = False) -> int:
    """A sealable memfd of ``size`` bytes (OSError where there is none or it cannot be sized)."""
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if hugetlb else 0)
    fd = os.memfd_create(name, flags)
    try:
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        raise
    return fd


def reserve(fd: int, mem: mmap.mmap) -> None:
    """Allocate every page of ``mem`` (a shared mapping of the whole of ``fd``) now. Raises
    OSError (ENOMEM, ENOSPC, EFAULT) when the memory is not there."""
    try:
        mem.madvise(_MADV_POPULATE_WRITE)
        return
    except OSError as e:
        if e.errno != errno.EINVAL:  # EINVAL: a kernel before 5.14
            raise
    os.posix_fallocate(fd, 0, len(mem))


def seal_size(fd: int) -> None:
    """The file's size is final: nobody can shrink (SIGBUS for whoever maps it) or grow it."""
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS | fcntl.F_SEAL_SEAL)


def share_read_only(fd: int) -> int:
    """Seal ``fd`` (mapped writable by its creator already, who keeps writing through that
    mapping) against every later write, resize and writable mapping, drop its mode to 0, and
    return a read-only descriptor of it for readers. Raises OSError (no /proc, no sealing)."""
    ro = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS | F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            log.warning("cpu tier: this kernel cannot seal the arena against future writes (Linux < 5.1): "
                        "clients still get a read-only descriptor")
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS | fcntl.F_SEAL_SEAL)
        os.fchmod(fd, 0)
    except BaseException:
        os.close(ro)
        raise
    return ro


def _thp_mode(which: str) -> str:
    """The kernel's transparent-huge-page mode for anonymous memory (``enabled``) or shmem/memfd
    (``shmem_enabled``): the bracketed word of its sysfs file, "" where there is none."""
    try:
        text = open(f"/sys/kernel/mm/transparent_hugepage/{which}").read()  # noqa: SIM115 - one read
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else ""


def page_kind(shared: bool, pinned: bool) -> str:
    """What pages an arena of ordinary pages gets: "thp" when the kernel gives it transparent
    huge pages (a private arena: numpy madvises large arrays; a memfd: we madvise it), else "4KiB"."""
    if pinned:
        return "pinned"
    if shared:
        return "thp" if _thp_mode("shmem_enabled") in ("always", "within_size", "advise", "force") else "4KiB"
    return "thp" if _thp_mode("enabled") in ("always", "madvise") else "4KiB"


def _hugetlb_fd(total: int) -> int | None:
    """A memfd of ``total`` bytes (a multiple of HUGE_PAGE) in reserved hugetlb pages, every page
    allocated now (None, logged, when they cannot be had)."""
    if not getattr(os, "MFD_HUGETLB", 0):
        log.warning("cpu tier: huge_pages asked for, but this platform has no MFD_HUGETLB: using ordinary pages")
        return None
    try:
        fd = memfd("tierkv-cpu-arena", total, hugetlb=True)
    except OSError as e:
        log.warning("cpu tier: no hugetlb memfd (%s): using ordinary pages", e)
        return None
    try:
        os.posix_fallocate(fd, 0, total)  # fails here, cleanly, when the pages are not there
        return fd
    except OSError as e:
        os.close(fd)
        log.warning("cpu tier: %d MiB of hugetlb pages not available (%s; reserve them with vm.nr_hugepages "
                    "or a pod's hugepages-2Mi): using ordinary pages", total >> 20, e.strerror or e)
        return None


def shared_arena(nbytes: int, huge_pages: bool = False) -> tuple[np.ndarray, ArenaShare, str] | None:
    """An arena in a memfd, every page reserved, and the kind of its pages (None, logged, where
    there is no memfd_create, the memory is not there, or it cannot be sealed). The returned array
    is the only writable mapping there will ever be; the caller owns ``ArenaShare.fd``, a
    read-only descriptor for clients. Also the memory bench.tiers copies its cpu baseline out
    of: the same kind of pages as the tier's."""
    if not nbytes or not hasattr(os, "memfd_create"):
        return None
    total = ARENA_HEADER + nbytes
    whole = -(-total // HUGE_PAGE) * HUGE_PAGE  # whole huge pages: both sides map (and unmap) all of it
    fd = _hugetlb_fd(whole) if huge_pages else None
    if fd is not None:
        total, kind = whole, "hugetlb"  # its size is set, every page allocated
    else:
        kind = page_kind(shared=True, pinned=False)
        try:
            fd = memfd("tierkv-cpu-arena", total)
        except OSError:
            return None
    try:
        mem = mmap.mmap(fd, total)
        if kind != "hugetlb":
            if hasattr(mmap, "MADV_HUGEPAGE"):
                try:
                    mem.madvise(mmap.MADV_HUGEPAGE)  # honoured where shmem THP is "advise"; before the pages exist
                except OSError:
                    pass
            reserve(fd, mem)
        token = secrets.token_bytes(TOKEN_BYTES)
        mem[:TOKEN_BYTES] = token
        ro = share_read_only(fd)
    except OSError as e:
        log.warning("cpu tier: no shared arena of %d MiB (%s): using private memory", total >> 20, e.strerror or e)
        return None
    finally:
        os.close(fd)  # the mapping keeps the file; clients get the read-only descriptor
    return np.frombuffer(mem, np.uint8, count=nbytes, offset=ARENA_HEADER), ArenaShare(ro, total, token), kind
