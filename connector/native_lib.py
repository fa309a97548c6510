"""The compiled library of csrc/ as ctypes functions: found, loaded once, self-tested.

Loading is lazy and never fails loudly: ``load()`` returns the library, or None with the reason
(not built, a stale build with another interface, a kernel that disagrees with python-xxhash);
connector/native.py then uses its numpy fallbacks and says why. The library picks its hash
kernel (scalar, AVX2, AVX-512) from the CPU at load time; the self-test checks the kernel it
picked, and steps down to a simpler one if that one disagrees.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
from pathlib import Path

import numpy as np
import xxhash

ABI = 3
KERNELS = ("scalar", "avx2", "avx512")
TOO_SHORT = -3  # the library's answer for a stream of <= 240 bytes (XXH3's short-input algorithms)
MIDSIZE_MAX = 240

I64x3 = ctypes.c_int64 * 3
_PAGES = ctypes.POINTER(ctypes.c_int64)
_vp, _i32, _i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64


def _library_path() -> Path | None:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = here / f"_native{suffix}"
        if p.exists():
            return p
    return None


def _declare(lib: ctypes.CDLL) -> None:
    lib.tkv_abi_version.restype = ctypes.c_int
    lib.tkv_copy_hash.argtypes = [ctypes.c_char_p, ctypes.c_size_t, _vp, I64x3, _PAGES, _vp, I64x3, _PAGES,
                                  _i64, _i64, _i64, _i32, ctypes.POINTER(ctypes.c_uint64)]
    lib.tkv_hash_bytes.argtypes = [_vp, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64)]
    lib.tkv_batch.argtypes = [_i32, _i64, _vp, _vp, _vp, _vp, I64x3, _vp, _i64, _i64, _i32, _i32, ctypes.c_double,
                              _vp, _vp]
    lib.tkv_pieces_hash.argtypes = [_i32, ctypes.c_char_p, ctypes.c_size_t, _vp, _vp, _i64, _i64, _i32,
                                    ctypes.POINTER(ctypes.c_uint64)]
    lib.tkv_set_impl.argtypes = [ctypes.c_int]
    lib.tkv_rerotate_f32.argtypes = [_vp, _i64, _i64, _i64, _i64, _vp, _vp, _vp, _vp, _i32]


def hash_bytes(lib: ctypes.CDLL, data: np.ndarray) -> int:
    d = ctypes.c_uint64()
    if lib.tkv_hash_bytes(data.ctypes.data, data.nbytes, ctypes.byref(d)) != 0:
        raise ValueError(f"{data.nbytes} bytes: too short for the native hash")
    return d.value


def _self_test(lib: ctypes.CDLL) -> str:
    """"" when the active kernel agrees with python-xxhash on lengths around every boundary the
    streaming code has (stripes, 1 KiB blocks) and on a strided copy, else what failed."""
    rng = np.random.default_rng(20240611)
    data = rng.integers(0, 256, 5000, dtype=np.uint8)
    for n in (241, 255, 256, 257, 319, 320, 1023, 1024, 1025, 1087, 2048, 4999):
        if hash_bytes(lib, data[:n]) != xxhash.xxh3_64(data[:n]).intdigest():
            return f"hash of {n} bytes differs from python-xxhash"
    pool = rng.integers(0, 256, (3, 2, 5, 72), dtype=np.uint8)  # 72: stripes straddle the pages
    out = np.zeros(3 * 2 * 2 * 72, np.uint8)
    ids = (ctypes.c_int64 * 2)(4, 1)
    prefix = bytes(range(64))
    digest = ctypes.c_uint64()
    rc = lib.tkv_copy_hash(prefix, len(prefix), pool.ctypes.data, I64x3(*pool.strides[:3]), ids, out.ctypes.data,
                           I64x3(2 * 2 * 72, 2 * 72, 72), None, 3, 2, 72, 1, ctypes.byref(digest))
    want = np.ascontiguousarray(pool[:, :, [4, 1]])
    if rc != 0 or not np.array_equal(out.reshape(want.shape), want):
        return "strided copy differs from numpy"
    if digest.value != xxhash.xxh3_64(prefix + want.tobytes()).intdigest():
        return "checksum of a strided copy differs from python-xxhash"
    return ""


@functools.cache
def load() -> tuple[ctypes.CDLL | None, str]:
    """(library, "") or (None, why not)."""
    path = _library_path()
    if path is None:
        return None, "extension not built (no C compiler at install time?)"
    try:
        lib = ctypes.CDLL(str(path))
        if lib.tkv_abi_version() != ABI:
            return None, f"{path.name} has an unexpected interface (rebuild it: pip install -e .)"
        _declare(lib)
    except (OSError, AttributeError) as e:
        return None, f"cannot load {path.name}: {e}"
    failures = []
    for impl in range(lib.tkv_best_impl(), -1, -1):  # the best kernel the CPU has, then simpler ones
        if lib.tkv_set_impl(impl) != 0:
            continue
        why = _self_test(lib)
        if not why:
            return lib, ""
        failures.append(f"{KERNELS[impl]}: {why}")
    return None, "self-test against python-xxhash failed (" + "; ".join(failures) + ")"


def kernel() -> str:
    """Name of the hash kernel in use ("" without the library)."""
    lib, _ = load()
    return KERNELS[lib.tkv_impl()] if lib is not None else ""


def supported_kernels() -> list[str]:
    lib, _ = load()
    return [] if lib is None else [k for i, k in enumerate(KERNELS) if lib.tkv_impl_supported(i)]


def use_kernel(name: str) -> str:
    """Switch the kernel (tests and the benchmark compare them); returns the previous one."""
    lib, why = load()
    if lib is None:
        raise RuntimeError(f"native ops unavailable: {why}")
    prev = kernel()
    if name not in KERNELS or lib.tkv_set_impl(KERNELS.index(name)) != 0:
        raise ValueError(f"kernel {name!r} is not supported on this CPU (supported: {supported_kernels()})")
    return prev
