"""Native data-path ops (csrc/) behind thin wrappers, with numpy fallbacks chosen automatically.

Two ops move a block between its wire layout ``[layers, 2, n, seg]`` (``seg``: the bytes of one
page of one layer's K or V) and pages of a KV pool seen as bytes ``[layers, 2, pages, seg]``:

- ``unpack_verify``: block payload -> pool pages, computing the block checksum (xxh3_64 of the
  zeroed header, then the payload; kvstore/block.py) over the bytes *as copied*; raises
  ChecksumError on a mismatch (the caller then never counts the pages).
- ``pack_checksum``: pool pages -> one contiguous payload, returning its checksum.

The native version does each in one pass (copy a cache-sized chunk, hash it from the
destination while it is in cache); the fallback copies everything, then hashes. Both give the
same bytes and the same checksum, bit for bit (tests/test_native_ops.py). The native library is
loaded lazily, self-tested against python-xxhash once, and ``status()`` says which one runs.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import logging
import operator
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import xxhash

from kvstore.block import _CHECKSUM_OFFSET, _FIXED, BlockHeader
from kvstore.errors import ChecksumError

log = logging.getLogger(__name__)

Buffer = bytes | bytearray | memoryview | np.ndarray
_I64x3 = ctypes.c_int64 * 3
_PAGES = ctypes.POINTER(ctypes.c_int64)


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


def _library_path() -> Path | None:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = here / f"_native{suffix}"
        if p.exists():
            return p
    return None


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    path = _library_path()
    if path is None:
        return None, "extension not built (no C compiler at install time?)"
    try:
        lib = ctypes.CDLL(str(path))
        xx = ctypes.CDLL(xxhash._xxhash.__file__)  # python-xxhash exports the XXH3_* API
        names = ("XXH3_createState", "XXH3_freeState", "XXH3_64bits_reset", "XXH3_64bits_update",
                 "XXH3_64bits_digest")
        fns = [ctypes.cast(getattr(xx, n), ctypes.c_void_p) for n in names]
    except (OSError, AttributeError) as e:
        return None, f"cannot load {path.name} or the xxhash entry points: {e}"
    lib.tkv_init.argtypes = [ctypes.c_void_p] * 5
    lib.tkv_copy_hash.argtypes = [
        ctypes.c_char_p, ctypes.c_size_t, ctypes.c_void_p, _I64x3, _PAGES,
        ctypes.c_void_p, _I64x3, _PAGES, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
        ctypes.POINTER(ctypes.c_uint64),
    ]
    if lib.tkv_abi_version() != 1 or lib.tkv_init(*fns) != 0:
        return None, f"{path.name} has an unexpected interface (rebuild it)"
    probe = np.arange(3 * 2 * 5 * 40, dtype=np.uint8).reshape(3, 2, 5, 40)
    out = np.empty(3 * 2 * 2 * 40, dtype=np.uint8)
    got = _pack_native(lib, b"probe", probe, _page_ids([4, 1], 5), out)
    want = xxhash.xxh3_64(b"probe" + np.ascontiguousarray(probe[:, :, [4, 1]]).tobytes()).intdigest()
    if got != want or not np.array_equal(out.reshape(3, 2, 2, 40), probe[:, :, [4, 1]]):
        return None, "self-test against python-xxhash failed"
    return lib, ""


def status() -> NativeStatus:
    lib, reason = _load()
    return NativeStatus("native", "") if lib is not None else NativeStatus("fallback", reason)


def log_status() -> NativeStatus:
    """Log (once per call: call it at start-up) which implementation the data path uses."""
    st = status()
    if st.impl == "native":
        log.info("data path: native unpack_verify/pack_checksum (csrc/)")
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


# ---- argument checks (every bad argument is a ValueError before any byte moves) -------------

def _pool_view(pool: np.ndarray, writable: bool) -> np.ndarray:
    if not isinstance(pool, np.ndarray) or pool.dtype != np.uint8 or pool.ndim != 4 or pool.shape[1] != 2:
        got = getattr(pool, "shape", type(pool).__name__)
        raise ValueError(f"pool must be a uint8 ndarray [layers, 2, pages, seg], got {got}")
    if writable and not pool.flags.writeable:
        raise ValueError("pool is read-only")
    return pool


def _page_ids(pages: Sequence[int], num_pages: int) -> ctypes.Array:
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
    return (ctypes.c_int64 * len(ids))(*ids)


def _flat(buf: Buffer, nbytes: int, what: str, writable: bool) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        if writable and not buf.flags.c_contiguous:
            raise ValueError(f"{what} must be C-contiguous")
        arr = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    else:
        arr = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    if arr.nbytes != nbytes:
        raise ValueError(f"{what} has {arr.nbytes} bytes, expected {nbytes}")
    if writable and not arr.flags.writeable:
        raise ValueError(f"{what} is read-only")
    return arr


def _native_ok(pool: np.ndarray, use_native: bool | None) -> ctypes.CDLL | None:
    lib, reason = _load()
    if use_native and lib is None:
        raise RuntimeError(f"native ops unavailable: {reason}")
    if use_native is False or lib is None or pool.strides[3] != 1:
        return None
    return lib


def _strides(a: np.ndarray) -> ctypes.Array:
    return _I64x3(*a.strides[:3])


def _pack_native(lib: ctypes.CDLL, prefix: bytes, pool: np.ndarray, ids: ctypes.Array, out: np.ndarray) -> int:
    layers, _, _, seg = pool.shape
    n = len(ids)
    digest = ctypes.c_uint64()
    rc = lib.tkv_copy_hash(prefix, len(prefix), pool.ctypes.data, _strides(pool), ids,
                           out.ctypes.data, _I64x3(2 * n * seg, n * seg, seg), None, layers, n, seg,
                           ctypes.byref(digest))
    if rc != 0:
        raise RuntimeError(f"tkv_copy_hash failed ({rc})")
    return digest.value


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
    ids = _page_ids(pages, num_pages)
    n = len(ids)
    src = _flat(payload, layers * 2 * n * seg, "payload", writable=False)
    if header.payload_len != src.nbytes:
        raise ValueError(f"header says {header.payload_len} payload bytes, got {src.nbytes}")
    prefix = hashed_header(header.raw)
    lib = _native_ok(pool, use_native)
    if lib is not None:
        digest = ctypes.c_uint64()
        rc = lib.tkv_copy_hash(prefix, len(prefix), src.ctypes.data, _I64x3(2 * n * seg, n * seg, seg), None,
                               pool.ctypes.data, _strides(pool), ids, layers, n, seg,
                               ctypes.byref(digest))
        if rc != 0:
            raise RuntimeError(f"tkv_copy_hash failed ({rc})")
        got = digest.value
    else:
        pool[:, :, list(ids)] = src.reshape(layers, 2, n, seg)
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
    ids = _page_ids(pages, num_pages)
    dst = _flat(out, layers * 2 * len(ids) * seg, "out", writable=True)
    prefix = bytes(prefix)
    lib = _native_ok(pool, use_native)
    if lib is not None:
        return _pack_native(lib, prefix, pool, ids, dst)
    dst.reshape(layers, 2, len(ids), seg)[:] = pool[:, :, list(ids)]
    h = xxhash.xxh3_64(prefix)
    h.update(dst)
    return h.intdigest()
