"""Make a disk tier's files cold before a timed point, and prove it: ``evict(files, pids)``.

"disk" in a bench means bytes read from the device, not from the page cache the previous point
left. Dropping is not one call here:
- the daemon maps its lmdb file, and the kernel drops no page a process maps, whatever asks
  (``drop_caches`` and ``posix_fadvise(DONTNEED)`` alike skip them), so first every page of the
  files that the daemon processes (``pids``) map is paged out from *their* address space:
  ``process_madvise(pidfd, MADV_PAGEOUT)`` (Linux >= 5.10; a clean file page mapped by one
  process is then reclaimed at once);
- then the files' remaining cached pages are dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)``
  (per file: the other benches on the machine keep their caches), or, with
  ``global_drop=True``, ``echo 1 > /proc/sys/vm/drop_caches`` where that is allowed (falling back
  to the per-file drop where it is refused, as it may be in a container);
- finally the share of the files' pages still cached is read with ``mincore`` on a fresh mapping
  (bench.tiers.page_cache.resident_fraction): ``verified`` when at most ``max_resident`` stayed.
``ColdResult.method`` names what was done, for the JSON (``disk_cold_method``). A VM's host may
still cache the disk image below us: the residency figure speaks for this kernel only.
Used by bench.e2e for every daemon_disk point; meant for bench.serve's daemon_disk mode too.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

from bench.tiers.page_cache import resident_fraction

MADV_PAGEOUT = 21
_SYS_PIDFD_OPEN, _SYS_PROCESS_MADVISE = 434, 440  # x86_64 and aarch64 (the generic table) alike
_libc = ctypes.CDLL(None, use_errno=True)
DEFAULT_MAX_RESIDENT = 0.05


class ColdDiskError(OSError):
    """The files could not be made cold (and the caller asked for proof)."""


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class ColdResult(NamedTuple):
    method: str  # e.g. "process_madvise(MADV_PAGEOUT)+posix_fadvise(DONTNEED)"
    resident_before: float  # share of the files' pages cached before (the largest file's figure)
    resident_after: float  # ... and after: the evidence
    verified: bool  # resident_after <= max_resident
    paged_out_bytes: int  # mapped bytes the daemons were asked to page out


def lmdb_files(path: str | os.PathLike[str]) -> list[Path]:
    """The files of an lmdb environment directory (data.mdb, lock.mdb) or the file itself."""
    p = Path(path)
    if p.is_dir():
        return sorted(q for q in p.iterdir() if q.is_file() and q.suffix == ".mdb")
    return [p] if p.exists() else []


def mapped_ranges(pid: int, files: Iterable[Path]) -> list[tuple[int, int]]:
    """(start, length) of every mapping of ``files`` in process ``pid`` (/proc/PID/maps)."""
    names = {str(Path(f).resolve()) for f in files}
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] in names:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi - lo))
    return out


def page_out(pid: int, ranges: Sequence[tuple[int, int]]) -> int:
    """``process_madvise(MADV_PAGEOUT)`` over ``ranges`` of process ``pid``; bytes advised."""
    if not ranges:
        return 0
    pidfd = _libc.syscall(_SYS_PIDFD_OPEN, ctypes.c_int(pid), ctypes.c_uint(0))
    if pidfd < 0:
        raise ColdDiskError(ctypes.get_errno(), f"pidfd_open({pid}) failed")
    try:
        done = 0
        for start, length in ranges:  # one range per call: a partial answer then says which one
            iov = _Iovec(start, length)
            n = _libc.syscall(_SYS_PROCESS_MADVISE, ctypes.c_int(pidfd), ctypes.byref(iov), ctypes.c_size_t(1),
                              ctypes.c_int(MADV_PAGEOUT), ctypes.c_uint(0))
            if n < 0:
                raise ColdDiskError(ctypes.get_errno(), f"process_madvise(MADV_PAGEOUT) on pid {pid} failed")
            done += n
        return done
    finally:
        os.close(pidfd)


def _drop_global() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def _drop_files(files: Iterable[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # a dirty page is not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def residency(files: Iterable[Path]) -> float:
    """The largest share of any one file's pages in the page cache (0.0 for no files)."""
    return max((resident_fraction(f) for f in files if f.stat().st_size), default=0.0)


def evict(files: Sequence[str | os.PathLike[str]], pids: Sequence[int] = (), *, global_drop: bool = False,
          max_resident: float = DEFAULT_MAX_RESIDENT, require: bool = False) -> ColdResult:
    """Make ``files`` cold (see the module docstring); ``require``: raise if not verified."""
    paths = [Path(f) for f in files]
    before = residency(paths)
    steps, paged = [], 0
    for pid in pids:
        paged += page_out(pid, mapped_ranges(pid, paths))
    if pids:
        steps.append("process_madvise(MADV_PAGEOUT)")
    if global_drop and _drop_global():
        steps.append("drop_caches=1")
    else:
        _drop_files(paths)
        steps.append("posix_fadvise(DONTNEED)" + (" (drop_caches refused)" if global_drop else ""))
    after = residency(paths)
    out = ColdResult("+".join(steps), before, after, after <= max_resident, paged)
    if require and not out.verified:
        raise ColdDiskError(0, f"{after:.1%} of the files' pages still cached after {out.method}")
    return out
