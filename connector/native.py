"""Native data-path ops (csrc/) behind thin wrappers, with numpy fallbacks chosen automatically.

The ops move blocks between their wire layout ``[layers, 2, n, seg]`` (``seg``: the bytes of
one page of one layer's K or V) and pages of a KV pool seen as bytes ``[layers, 2, pages, seg]``:

- ``unpack_verify``: block payload -> pool pages, computing the block checksum (xxh3_64 of the
  zeroed header, then the payload; kvstore/block.py) over the bytes *as copied*; raises
  ChecksumError on a mismatch (the caller then never counts the pages).
- ``pack_checksum``: pool pages -> one contiguous payload, returning its checksum.
(``connector.native_batch`` does the same for many one-page blocks in one call, on several threads.)

The native version does each block in one pass: every 64-byte stripe is read once, written,
and hashed from the same registers (csrc/xxh3_copy.c), so the checksum is of exactly the bytes
that landed. The fallback copies, then hashes the destination. Both give the same bytes and the
same checksum, bit for bit (tests/connector/native/test_ops.py). Streams of at most 240 bytes (XXH3's
short-input algorithms, never a real KV page) take the fallback. The library is loaded lazily
and self-tested (connector/native_lib.py); ``status()`` says which implementation runs.
"""

from __future__ import annotations

import ctypes
import logging
import operator
import os
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import xxhash

from connector import native_lib
from kvstore.block import _CHECKSUM_OFFSET, _FIXED, BlockHeader
from kvstore.errors import ChecksumError

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview | np.ndarray
NT_MIN_BYTES = 256 * 1024  # from this size on, stores bypass the cache (the pool is not read back soon)
THREAD_MIN_BYTES = 4 * 2**20  # below this a batch runs on the calling thread alone


class NativeStatus(NamedTuple):
    impl: str  # "native" | "fallback"
    reason: str  # why the fallback is used ("" when native)


def hashed_header(raw: bytes) -> bytes:
    """The bytes a block's checksum starts with: its header with the checksum field zeroed."""
    return raw[:_CHECKSUM_OFFSET] + b"\0" * 8 + raw[_FIXED.size :]


def page_bytes(kv: torch.Tensor) -> np.ndarray:
    """A host KV tensor ``[layers, 2, pages, ...]`` (any strides along those three axes) as the
    bytes ``[layers, 2, pages, seg]`` the ops take: a view, never a copy."""
    arr = kv.view(torch.uint8).numpy()
    out = arr.reshape(*arr.shape[:3], -1)
    if not np.may_share_memory(out, arr):  # reshape had to copy: a page's bytes are not contiguous
        raise ValueError(f"KV tensor of strides {kv.stride()} has no contiguous page bytes")
    return out


def status() -> NativeStatus:
    lib, reason = native_lib.load()
    return NativeStatus("native", "") if lib is not None else NativeStatus("fallback", reason)


def log_status() -> NativeStatus:
    """Log (once per call: call it at start-up) which implementation the data path uses."""
    st = status()
    if st.impl == "native":
        log.info("data path: native unpack_verify/pack_checksum (csrc/, %s kernel)", native_lib.kernel())
    else:
        log.warning("data path: numpy fallback for unpack_verify/pack_checksum: %s", st.reason)
    return st


def info_gauge(registry: object):
    """A ``tierkv_native_info`` gauge (value 1, labels impl and reason) in ``registry``."""
    from prometheus_client import Gauge

    st = status()
    g = Gauge("tierkv_native_info", "Implementation of the KV data-path ops (1 = in use)", ["impl", "reason"],
              registry=registry)
    g.labels(impl=st.impl, reason=st.reason).set(1)
    return g


def default_threads() -> int:
    """Threads a large batch uses: the cores this process may run on (at most 4)."""
    try:
        return max(1, min(4, len(os.sched_getaffinity(0))))
    except (AttributeError, OSError):
        return max(1, min(4, os.cpu_count() or 1))


# ---- argument checks (every bad argument is a ValueError before any byte moves) -------------

def _pool_view(pool: np.ndarray, writable: bool) -> np.ndarray:
    if not isinstance(pool, np.ndarray) or pool.dtype != np.uint8 or pool.ndim != 4 or pool.shape[1] != 2:
        got = getattr(pool, "shape", type(pool).__name__)
        raise ValueError(f"pool must be a uint8 ndarray [layers, 2, pages, seg], got {got}")
    if writable and not pool.flags.writeable:
        raise ValueError("pool is read-only")
    return pool


def _page_list(pages: Sequence[int], num_pages: int) -> list[int]:
    try:
        ids = [operator.index(p) for p in pages]
    except TypeError as e:
        raise ValueError(f"pages must be integers, got {pages!r}") from e
    if not ids:
        raise ValueError("pages is empty")
    if min(ids) < 0 or max(ids) >= num_pages:
        raise ValueError(f"page index outside 0..{num_pages - 1}: {ids}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"duplicate page in {ids}")
    return ids


def _flat(buf: Buffer, nbytes: int, what: str, writable: bool) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        if writable and not buf.flags.c_contiguous:
            raise ValueError(f"{what} must be C-contiguous")
        arr = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    else:
        try:
            arr = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
        except TypeError as e:  # a non-contiguous memoryview, or not a buffer at all
            raise ValueError(f"{what} must be a contiguous buffer: {e}") from e
    if arr.nbytes != nbytes:
        raise ValueError(f"{what} has {arr.nbytes} bytes, expected {nbytes}")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{what} is read-only")
    return arr


def _native(pool: np.ndarray, use_native: bool | None) -> ctypes.CDLL | None:
    lib, reason = native_lib.load()
    if use_native and lib is None:
        raise RuntimeError(f"native ops unavailable: {reason}")
    if use_native is False or lib is None or pool.strides[3] != 1:
        return None
    return lib


def _flags(nbytes: int) -> int:
    return 1 if nbytes >= NT_MIN_BYTES else 0


def _copy_hash(lib: ctypes.CDLL, prefix: bytes, src: np.ndarray, src_strides: Sequence[int], src_pages,
               dst: np.ndarray, dst_strides: Sequence[int], dst_pages, layers: int, n: int, seg: int) -> int | None:
    """The native one-pass copy + checksum; None when the stream is too short for it."""
    digest = ctypes.c_uint64()
    rc = lib.tkv_copy_hash(prefix, len(prefix), src.ctypes.data, native_lib.I64x3(*src_strides), src_pages,
                           dst.ctypes.data, native_lib.I64x3(*dst_strides), dst_pages, layers, n, seg,
                           _flags(layers * 2 * n * seg), ctypes.byref(digest))
    if rc == native_lib.TOO_SHORT:
        return None
    if rc != 0:
        raise RuntimeError(f"tkv_copy_hash failed ({rc})")
    return digest.value


def _c_pages(ids: list[int]) -> ctypes.Array:
    return (ctypes.c_int64 * len(ids))(*ids)


# ---- the ops ---------------------------------------------------------------------------------

def unpack_verify(header: BlockHeader, payload: Buffer, pool: np.ndarray, pages: Sequence[int],
                  use_native: bool | None = None) -> None:
    """Copy ``payload`` (a block's ``[layers, 2, len(pages), seg]`` bytes) into ``pool`` pages
    ``pages`` (in that order) and check the checksum of what was copied against ``header``.

    Raises ChecksumError on a mismatch (the pages then hold the bad bytes: do not use them),
    ValueError on bad arguments. ``use_native``: None picks the native op when it is available.
    """
    pool = _pool_view(pool, writable=True)
    layers, _, num_pages, seg = pool.shape
    ids = _page_list(pages, num_pages)
    n = len(ids)
    src = _flat(payload, layers * 2 * n * seg, "payload", writable=False)
    if header.payload_len != src.nbytes:
        raise ValueError(f"header says {header.payload_len} payload bytes, got {src.nbytes}")
    prefix = hashed_header(header.raw)
    lib = _native(pool, use_native)
    got = None
    if lib is not None:
        got = _copy_hash(lib, prefix, src, (2 * n * seg, n * seg, seg), None, pool, pool.strides[:3], _c_pages(ids),
                         layers, n, seg)
    if got is None:
        pool[:, :, ids] = src.reshape(layers, 2, n, seg)
        h = xxhash.xxh3_64(prefix)
        for layer in range(layers):
            for kv in (0, 1):
                for p in ids:
                    h.update(np.ascontiguousarray(pool[layer, kv, p]))
        got = h.intdigest()
    if got != header.checksum:
        raise ChecksumError(f"checksum mismatch for block {header.key.hex()[:16]} (as copied)")


def pack_checksum(prefix: bytes, pool: np.ndarray, pages: Sequence[int], out: Buffer,
                  use_native: bool | None = None) -> int:
    """Gather ``pool`` pages ``pages`` into ``out`` (``[layers, 2, len(pages), seg]`` bytes,
    writable, contiguous) and return xxh3_64 of ``prefix`` followed by what was written."""
    pool = _pool_view(pool, writable=False)
    layers, _, num_pages, seg = pool.shape
    ids = _page_list(pages, num_pages)
    n = len(ids)
    dst = _flat(out, layers * 2 * n * seg, "out", writable=True)
    prefix = bytes(prefix)
    lib = _native(pool, use_native)
    if lib is not None:
        got = _copy_hash(lib, prefix, pool, pool.strides[:3], _c_pages(ids), dst, (2 * n * seg, n * seg, seg), None,
                         layers, n, seg)
        if got is not None:
            return got
    dst.reshape(layers, 2, n, seg)[:] = pool[:, :, ids]
    h = xxhash.xxh3_64(prefix)
    h.update(dst)
    return h.intdigest()



# ---- blocks whose pieces lie apart (vLLM: one KV tensor per layer) ---------------------------

def _piece_views(pieces: np.ndarray, seg: int) -> list[np.ndarray]:
    return [np.frombuffer((ctypes.c_ubyte * seg).from_address(int(a)), dtype=np.uint8) for a in pieces]


def _pieces_args(pieces: Sequence[int] | np.ndarray, seg: int, buf: np.ndarray) -> np.ndarray:
    addrs = np.ascontiguousarray(pieces, dtype=np.uint64)
    if addrs.ndim != 1 or not addrs.size or seg <= 0:
        raise ValueError(f"need >= 1 piece address and seg > 0, got {addrs.shape} pieces of {seg} bytes")
    if buf.nbytes != addrs.size * seg:
        raise ValueError(f"buffer has {buf.nbytes} bytes, {addrs.size} pieces of {seg} make {addrs.size * seg}")
    return addrs


def scatter_verify(header: BlockHeader, payload: Buffer, pieces: Sequence[int] | np.ndarray, seg: int,
                   use_native: bool | None = None) -> None:
    """Copy ``payload`` into the pieces at the addresses ``pieces`` (``seg`` bytes each, in payload
    order) and check the checksum of what was copied against ``header``: ChecksumError on a
    mismatch (the pieces then hold the bad bytes: do not use them).

    The addresses are trusted: the caller (connector/vllm/worker.py's BlockLayout, which derives
    them from tensors it holds and block ids it bounds-checks) owns ``seg`` writable bytes at each.
    """
    src = _flat(payload, header.payload_len, "payload", writable=False)
    addrs = _pieces_args(pieces, seg, src)
    prefix = hashed_header(header.raw)
    lib, _ = native_lib.load()
    if use_native and lib is None:
        raise RuntimeError("native ops unavailable")
    got = None
    if lib is not None and use_native is not False:
        digest = ctypes.c_uint64()
        rc = lib.tkv_pieces_hash(0, prefix, len(prefix), src.ctypes.data, addrs.ctypes.data, addrs.size, seg,
                                 _flags(src.nbytes), ctypes.byref(digest))  # fmt: skip
        if rc not in (0, native_lib.TOO_SHORT):
            raise RuntimeError(f"tkv_pieces_hash failed ({rc})")
        got = digest.value if rc == 0 else None
    if got is None:
        h = xxhash.xxh3_64(prefix)
        for i, view in enumerate(_piece_views(addrs, seg)):
            view[:] = src[i * seg : (i + 1) * seg]
            h.update(view)  # what landed, not what was sent
        got = h.intdigest()
    if got != header.checksum:
        raise ChecksumError(f"checksum mismatch for block {header.key.hex()[:16]} (as copied)")


def gather_checksum(prefix: bytes, pieces: Sequence[int] | np.ndarray, seg: int, out: Buffer,
                    use_native: bool | None = None) -> int:
    """Gather the pieces at the addresses ``pieces`` (``seg`` readable bytes each, trusted as in
    ``scatter_verify``) into ``out`` in order and return xxh3_64 of ``prefix`` then what was written."""
    dst = _flat(out, len(pieces) * seg, "out", writable=True)
    addrs = _pieces_args(pieces, seg, dst)
    prefix = bytes(prefix)
    lib, _ = native_lib.load()
    if use_native and lib is None:
        raise RuntimeError("native ops unavailable")
    if lib is not None and use_native is not False:
        digest = ctypes.c_uint64()
        rc = lib.tkv_pieces_hash(1, prefix, len(prefix), dst.ctypes.data, addrs.ctypes.data, addrs.size, seg, 0,
                                 ctypes.byref(digest))  # fmt: skip
        if rc == 0:
            return digest.value
        if rc != native_lib.TOO_SHORT:
            raise RuntimeError(f"tkv_pieces_hash failed ({rc})")
    for i, view in enumerate(_piece_views(addrs, seg)):
        dst[i * seg : (i + 1) * seg] = view
    h = xxhash.xxh3_64(prefix)
    h.update(dst)
    return h.intdigest()
