"""Cold reads of a file for bench.tiers (Linux): drop its cached pages, measure how many stayed,
and read byte ranges with O_DIRECT (no page cache at all) as the cold baseline.

- ``drop_pages``: ``posix_fadvise(POSIX_FADV_DONTNEED)`` over the whole file. The kernel keeps
  pages that a process still maps or that are dirty, so callers close every mapping of the file
  (an lmdb environment maps its data file) and the data was fsynced when written.
- ``resident_fraction``: the share of the file's pages in the page cache, from ``mincore`` on a
  fresh read-only mapping: the evidence that a drop worked.
- ``DirectReader``: ``O_DIRECT`` reads into one page-aligned buffer from an anonymous mmap
  (``read``: valid until the next read), or into a fresh one per read (``read_fresh``: memory
  the caller owns, as a tier's ``get`` result is).
  O_DIRECT needs aligned offsets and lengths, so a range is read from the page boundary below it
  to the page boundary above it (at most two extra pages of I/O per range). With ``workers > 1``
  a range is read as ``chunk_bytes`` pieces by that many threads at once (``preadv`` releases the
  GIL): several requests in flight, as the kernel's readahead keeps for buffered reads.
- ``lmdb_value_span``: where in ``data.mdb`` a value read through a ``buffers=True`` transaction
  lies (its address minus the address the file is mapped at, from /proc/self/maps), so the
  O_DIRECT baseline reads exactly the bytes lmdb reads.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


class PageCacheError(OSError):
    """The page cache could not be dropped, inspected or bypassed on this file system."""


def drop_pages(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_fraction(path: str | os.PathLike[str]) -> float:
    """Share of the file's pages that are in the page cache now (0.0 for an empty file)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise PageCacheError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = (size + PAGE - 1) // PAGE
            vec = ctypes.create_string_buffer(pages)
            if _libc.mincore(addr, size, vec) != 0:
                raise PageCacheError(ctypes.get_errno(), f"mincore of {path} failed")
            return sum(b & 1 for b in vec.raw) / pages
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def _align_down(n: int) -> int:
    return n // PAGE * PAGE


def _align_up(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


class DirectReader:
    """O_DIRECT reads of ``(offset, length)`` ranges of one file into an aligned buffer of ours."""

    def __init__(self, path: str | os.PathLike[str], max_length: int, *, workers: int = 1,
                 chunk_bytes: int = 256 * 1024) -> None:
        if workers < 1 or chunk_bytes <= 0 or chunk_bytes % PAGE:
            raise ValueError(f"workers must be >= 1 and chunk_bytes a positive multiple of {PAGE}")
        self._chunk = chunk_bytes
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="odirect") if workers > 1 else None
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:  # tmpfs and some overlay file systems refuse O_DIRECT
            raise PageCacheError(e.errno, f"O_DIRECT open of {path}: {e.strerror}") from e
        self._buf = mmap.mmap(-1, _align_up(max_length) + 2 * PAGE)  # anonymous: page-aligned
        self._view = memoryview(self._buf)

    def read(self, offset: int, length: int) -> memoryview:
        """The bytes [offset, offset + length), valid until the next read."""
        start, end = _align_down(offset), _align_up(offset + length)
        if end - start > len(self._buf):
            raise PageCacheError(0, f"range of {length} bytes exceeds the reader's buffer")
        pieces = [(p, min(p + self._chunk, end)) for p in range(start, end, self._chunk)]
        if self._pool is None or len(pieces) == 1:
            got = [self._read_piece(start, start, end)]
        else:
            got = list(self._pool.map(lambda pe: self._read_piece(start, *pe), pieces))
        if sum(got) < offset + length - start:
            raise PageCacheError(0, f"short O_DIRECT read: {sum(got)} of {end - start} bytes at {start}")
        return self._view[offset - start : offset - start + length]

    def read_fresh(self, offset: int, length: int) -> memoryview:
        """The bytes [offset, offset + length) in memory of their own (a fresh anonymous mmap the
        returned view keeps alive): owned by the caller, as a tier's ``get`` result is, with no
        copy after the read. One request per range."""
        start, end = _align_down(offset), _align_up(offset + length)
        buf = mmap.mmap(-1, end - start)
        view = memoryview(buf)
        got = os.preadv(self._fd, [view], start)
        if got < offset + length - start:
            raise PageCacheError(0, f"short O_DIRECT read: {got} of {end - start} bytes at {start}")
        return view[offset - start : offset - start + length]

    def _read_piece(self, base: int, lo: int, hi: int) -> int:
        """Read file bytes [lo, hi) into the buffer at lo - base; returns the count read."""
        return os.preadv(self._fd, [self._view[lo - base : hi - base]], lo)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
        self._view.release()
        self._buf.close()
        os.close(self._fd)

    def __enter__(self) -> DirectReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _mapping_of(path: Path) -> tuple[int, int]:
    """(start address, file offset) of the mapping of ``path`` in this process."""
    target = str(path.resolve())
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] == target:
            return int(parts[0].split("-")[0], 16), int(parts[2], 16)
    raise PageCacheError(0, f"{target} is not mapped in this process")


def lmdb_value_span(data_file: str | os.PathLike[str], value: memoryview) -> tuple[int, int]:
    """(file offset, length) of ``value``, a buffer returned by a ``buffers=True`` lmdb txn."""
    start, file_off = _mapping_of(Path(data_file))
    addr = np.frombuffer(value, dtype=np.uint8).ctypes.data
    return addr - start + file_off, value.nbytes
