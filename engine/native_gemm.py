"""csrc/gemm.c as a linear form for engine/cpu_gemm.py: ``x @ w^T`` for a step of a few rows, fp32.

The library is found next to this file (built by ``pip install -e .`` as ``engine._gemm``), loaded
once with ctypes and self-tested: each kernel the CPU has (AVX-512, AVX2+FMA, scalar) against a
float64 product, and every kernel against the others bit for bit (they sum in the same order).
Loading never fails loudly: ``load()`` returns the library or None with the reason, and the engine
then chooses among torch's forms only, saying why in its log.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
from pathlib import Path

import torch

ABI = 1
KERNELS = ("scalar", "avx2", "avx512")
_i64, _vp = ctypes.c_int64, ctypes.c_void_p


def _library_path() -> Path | None:
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = here / f"_gemm{suffix}"
        if p.exists():
            return p
    return None


def _self_test(lib: ctypes.CDLL) -> str:
    """"" when every kernel the CPU has is close to a float64 product on shapes with every tail
    (rows past a register block, columns past a block of 4 and a thread's share, K % 16) and all
    of them give the same bits; else what failed."""
    g = torch.Generator().manual_seed(20261207)
    cases = [(torch.randn(m, kk, generator=g), torch.randn(n, kk, generator=g))
             for m, n, kk in ((1, 5, 7), (7, 131, 33), (13, 300, 576), (2, 64, 16))]
    first: list[torch.Tensor] = []
    for k in range(len(KERNELS) - 1, -1, -1):
        if lib.tkv_gemm_set_kernel(k) != 0:
            continue
        outs = []
        for x, w in cases:
            (m, kk), n = x.shape, w.shape[0]
            y = torch.empty(m, n)
            if lib.tkv_sgemm_nt(x.data_ptr(), kk, w.data_ptr(), kk, y.data_ptr(), n, m, n, kk, 2) != 0:
                return f"{KERNELS[k]}: refused {m}x{kk} @ {n}x{kk}"
            ref = x.double() @ w.double().T
            if not torch.allclose(y.double(), ref, rtol=1e-4, atol=1e-4 * kk ** 0.5):
                return f"{KERNELS[k]}: {m}x{kk} @ {n}x{kk} off by {float((y.double() - ref).abs().max()):.2e}"
            outs.append(y)
        if first and not all(torch.equal(a, b) for a, b in zip(first, outs, strict=True)):
            return f"{KERNELS[k]} gives other bits than the widest kernel"
        first = first or outs
    return ""


@functools.cache
def load() -> tuple[ctypes.CDLL | None, str]:
    """(library with its best kernel active, "") or (None, why not)."""
    path = _library_path()
    if path is None:
        return None, "engine._gemm not built (no C compiler at install time?)"
    try:
        lib = ctypes.CDLL(str(path))
        if lib.tkv_gemm_abi() != ABI:
            return None, f"{path.name} has an unexpected interface (rebuild it: pip install -e .)"
        lib.tkv_sgemm_nt.argtypes = [_vp, _i64, _vp, _i64, _vp, _i64, _i64, _i64, _i64, ctypes.c_int]
        lib.tkv_gemm_set_kernel.argtypes = [ctypes.c_int]
    except (OSError, AttributeError) as e:
        return None, f"cannot load {path.name}: {e}"
    best = next(k for k in range(len(KERNELS) - 1, -1, -1) if lib.tkv_gemm_set_kernel(k) == 0)
    why = _self_test(lib)
    lib.tkv_gemm_set_kernel(best)
    return (None, f"self-test failed: {why}") if why else (lib, "")


def kernel() -> str:
    """The kernel in use ("" without the library)."""
    lib, _ = load()
    return KERNELS[lib.tkv_gemm_kernel()] if lib is not None else ""


def use_kernel(name: str) -> str:
    """Switch the kernel (tests compare them); returns the previous one. ValueError if the CPU lacks it."""
    lib, why = load()
    if lib is None:
        raise RuntimeError(f"native gemm unavailable: {why}")
    prev = kernel()
    if name not in KERNELS or lib.tkv_gemm_set_kernel(KERNELS.index(name)) != 0:
        raise ValueError(f"kernel {name!r} is not supported on this CPU")
    return prev


class NativeLinear:
    """``x @ w^T (+ b)`` with csrc/gemm.c on ``threads`` threads; torch's ``F.linear`` for what the
    kernel does not take (another dtype, a device, a row of x that is not contiguous)."""

    __slots__ = ("lib", "threads")

    def __init__(self, lib: ctypes.CDLL, threads: int) -> None:
        self.lib, self.threads = lib, max(1, threads)

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if (x.dtype != torch.float32 or w.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1
                or w.stride(1) != 1 or x.device.type != "cpu" or w.device.type != "cpu"):
            return torch.nn.functional.linear(x, w, b)
        m, k = x.shape
        n = w.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        ldx = x.stride(0) if m > 1 else k  # a lone row's stride is whatever torch says: its row is contiguous
        if self.lib.tkv_sgemm_nt(x.data_ptr(), ldx, w.data_ptr(), w.stride(0), y.data_ptr(), n, m, n, k,
                                 self.threads) != 0:
            raise ValueError(f"native gemm refused {m}x{k} @ {tuple(w.shape)}^T")
        return y if b is None else y.add_(b)


def linear(threads: int) -> NativeLinear | None:
    """The native form at ``threads`` threads, or None without the library (``load`` says why)."""
    lib, _ = load()
    return NativeLinear(lib, threads) if lib is not None else None
