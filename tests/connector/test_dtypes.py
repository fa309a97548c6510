"""The one torch <-> block dtype map: every KV dtype round-trips bit-exactly through a block."""

from __future__ import annotations

import pytest
import torch

from connector.dtypes import block_dtype, from_block_array, to_block_array
from kvstore.block import decode_block, encode_block


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_through_a_block(dtype: torch.dtype) -> None:
    t = torch.randn(2, 2, 16, 3, 8).to(dtype)
    arr, name = to_block_array(t)
    blk = decode_block(encode_block(b"k" * 16, arr, dtype=name, layout="L2PHD"), verify=True)
    assert blk.dtype.str == block_dtype(dtype)
    back = from_block_array(blk.array())
    assert back.dtype == dtype and torch.equal(back, t)
