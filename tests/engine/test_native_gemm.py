"""engine/native_gemm.py and csrc/gemm.c: x @ w^T for a step of a few rows, as F.linear computes it
(to float rounding), the same bits from every kernel, and a row's result independent of the rest of
the step."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from connector import native
from engine import native_gemm

lib, why = native_gemm.load()
if lib is None and native.status().impl == "native":  # the same compiler built both: this one must load
    raise AssertionError(f"engine._gemm did not load beside the connector's native library: {why}")
pytestmark = pytest.mark.skipif(lib is None, reason=f"native gemm unavailable: {why}")

KERNELS = [k for k in native_gemm.KERNELS if lib is not None and lib.tkv_gemm_set_kernel(native_gemm.KERNELS.index(k)) == 0]
if lib is not None:
    native_gemm.use_kernel(native_gemm.KERNELS[max(native_gemm.KERNELS.index(k) for k in KERNELS)])


@pytest.fixture
def kernel(request):  # noqa: ANN001, ANN201
    prev = native_gemm.use_kernel(request.param)
    yield request.param
    native_gemm.use_kernel(prev)


# rows past a register block (6) and the AVX2 pair; columns past a block of 4 and a thread's
# share; K with and without a tail past a multiple of 16
SHAPES = [(1, 1, 1), (1, 5, 7), (2, 64, 16), (6, 130, 576), (7, 131, 33), (13, 257, 1536), (17, 64, 48)]


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_each_kernel_is_the_product(kernel: str, m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    lin = native_gemm.linear(2)
    assert lin is not None
    got = lin(x, w, b)
    assert got.shape == (m, n) and got.is_contiguous() and got.dtype == torch.float32
    ref = (x.double() @ w.double().T + b.double()).float()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * k**0.5)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-4, atol=1e-4 * k**0.5)


def test_every_kernel_gives_the_same_bits() -> None:
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(9, 100, generator=g), torch.randn(77, 100, generator=g)
    lin = native_gemm.linear(2)
    outs = []
    for k in KERNELS:
        prev = native_gemm.use_kernel(k)
        outs.append(lin(x, w))
        native_gemm.use_kernel(prev)
    assert all(torch.equal(outs[0], o) for o in outs[1:]), KERNELS


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_rows_result_does_not_depend_on_the_step_or_the_threads(threads: int) -> None:
    """Each output is one sum in one order, whatever the row count, the register block a row falls
    in, or the thread its columns went to: a request's logits do not move with who else is in the step."""
    g = torch.Generator().manual_seed(threads)
    x, w = torch.randn(20, 576, generator=g), torch.randn(300, 576, generator=g)
    alone = torch.cat([native_gemm.linear(1)(x[i : i + 1], w) for i in range(20)])
    for rows in (2, 5, 6, 7, 13, 20):
        together = native_gemm.linear(threads)(x[:rows], w)
        assert torch.equal(together, alone[:rows]), rows
    assert torch.equal(native_gemm.linear(threads)(x[3:9], w), alone[3:9])


def test_strided_rows_and_what_it_does_not_take() -> None:
    g = torch.Generator().manual_seed(3)
    gate_up = torch.randn(5, 2 * 96, generator=g)
    gate = gate_up[:, :96]  # the engine's silu(gate) * up: rows with a stride of their own
    w = torch.randn(40, 96, generator=g)
    lin = native_gemm.linear(2)
    torch.testing.assert_close(lin(gate, w), F.linear(gate, w), rtol=1e-4, atol=1e-3)
    for one in (gate_up[2:3, :96], torch.randn(96, 1, generator=g).t()):  # a lone row: any stride (here 192, 1)
        torch.testing.assert_close(lin(one, w), F.linear(one, w), rtol=1e-4, atol=1e-3)
    # another dtype or columns that are not contiguous: F.linear's own answer
    xb, wb = gate.to(torch.bfloat16), w.to(torch.bfloat16)
    assert torch.equal(lin(xb, wb), F.linear(xb, wb))
    cols = torch.randn(96, 5, generator=g).t()
    assert torch.equal(lin(cols, w), F.linear(cols, w))


def test_the_library_refuses_arguments_it_cannot_take() -> None:
    x, w, y = torch.zeros(2, 8), torch.zeros(4, 8), torch.zeros(2, 4)
    args = [x.data_ptr(), 8, w.data_ptr(), 8, y.data_ptr(), 4]
    assert lib.tkv_sgemm_nt(*args, 2, 4, 8, 2) == 0
    assert lib.tkv_sgemm_nt(x.data_ptr(), 4, w.data_ptr(), 8, y.data_ptr(), 4, 2, 4, 8, 2) == -1  # ldx < K
    assert lib.tkv_sgemm_nt(*args[:5], 3, 2, 4, 8, 2) == -1  # ldy < N
    assert lib.tkv_sgemm_nt(*args, -1, 4, 8, 2) == -1
    assert native_gemm.use_kernel(native_gemm.kernel()) in native_gemm.KERNELS
    with pytest.raises(ValueError, match="not supported"):
        native_gemm.use_kernel("sse9")
    assert isinstance(lib, ctypes.CDLL)
