"""CacheBlend's K re-rotation (csrc/rope.c via connector/native_rope.py) equals the torch version
bit for bit: random shapes, positions moved both ways, rows that stay (identity tables), any
thread count; other dtypes and strided K take torch; bad shapes are ValueErrors."""

from __future__ import annotations

import pytest
import torch

from connector import native, native_rope
from engine.rope import Rotary

needs_native = pytest.mark.skipif(native.status().impl != "native",
                                  reason=f"native ops not built: {native.status().reason}")


def _tables(rotary: Rotary, old: torch.Tensor, new: torch.Tensor) -> native_rope.Tables:
    """As connector/blend/blender.py builds them: rows that do not move get the identity."""
    cos_o, sin_o = rotary.cos_sin(old)
    cos_n, sin_n = rotary.cos_sin(new)
    still = (old == new)[:, None, None]
    one, zero = torch.ones_like(cos_o), torch.zeros_like(sin_o)
    return (torch.where(still, one, cos_o), torch.where(still, zero, -sin_o),
            torch.where(still, one, cos_n), torch.where(still, zero, sin_n))


def _case(seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, native_rope.Tables]:
    g = torch.Generator().manual_seed(seed)
    layers, n, heads = (int(x) for x in torch.randint(1, 7, (3,), generator=g))
    n *= 13
    dim = 2 * int(torch.randint(1, 40, (1,), generator=g))
    rotary = Rotary(dim, 10000.0 if seed % 2 else 500000.0, 64)
    new = torch.arange(n)
    old = new + torch.randint(-50, 5000, (n,), generator=g).clamp(min=-new)  # some rows stay
    old[: n // 3] = new[: n // 3]
    k = (torch.randn(layers, n, heads, dim, generator=g) * 4).to(dtype)
    return k, _tables(rotary, old, new)


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("seed", range(8))
def test_native_equals_torch_bit_for_bit(seed: int, threads: int) -> None:
    k, tables = _case(seed)
    want = native_rope.rerotate_torch(k, tables)
    got = native_rope.rerotate(k.clone(), tables, use_native=True, threads=threads)
    assert torch.equal(got, want)


@needs_native
def test_in_place_and_identity_rows_untouched() -> None:
    k, tables = _case(3)
    n = k.shape[1]
    buf = k.clone()
    out = native_rope.rerotate(buf, tables, use_native=True)
    assert out.data_ptr() == buf.data_ptr()  # rotated in place
    assert torch.equal(out[:, : n // 3], k[:, : n // 3])  # rows that stay are reused bit for bit


def test_other_dtypes_and_strided_k_take_torch() -> None:
    k, tables = _case(4, torch.bfloat16)
    assert torch.equal(native_rope.rerotate(k, tables), native_rope.rerotate_torch(k, tables))
    k32, t32 = _case(5)
    strided = k32.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    assert torch.equal(native_rope.rerotate(strided, t32), native_rope.rerotate_torch(k32, t32))
    with pytest.raises(RuntimeError):
        native_rope.rerotate(strided, t32, use_native=True)


def test_bad_shapes_are_value_errors() -> None:
    k, tables = _case(6)
    with pytest.raises(ValueError, match="even"):
        native_rope.rerotate(k[..., :-1], tables)
    with pytest.raises(ValueError, match="table 2"):
        native_rope.rerotate(k, (tables[0], tables[1], tables[2][:-1], tables[3]))
    with pytest.raises(ValueError, match="4 rotation tables"):
        native_rope.rerotate(k, tables[:3])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="threads"):
        native_rope.rerotate(k, tables, threads=0)
