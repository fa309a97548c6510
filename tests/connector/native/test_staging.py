"""Offload staging: pages leave the pool as encoded blocks byte for byte equal to what
``encode_block`` makes of them (fp32 and bf16, host and accelerator paths, pages out of order)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from connector.dtypes import to_block_array
from connector.staging import LAYOUT, StagedPages
from engine.kv_pool import KVPool
from kvstore.block import decode_block, encode_block
from kvstore.keys import BlockKey


@pytest.mark.parametrize("in_place", [True, False], ids=["host-pool", "accelerator-path"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_staged_blocks_equal_encode_block(tiny, in_place: bool, dtype: torch.dtype) -> None:
    pool = KVPool(tiny.arch, num_pages=7, page_size=4, dtype=dtype, device=torch.device("cpu"))
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(1)).to(dtype))
    pages = [5, 0, 3]
    keys = [BlockKey(b"stage-%04d" % p) for p in pages]
    staged = StagedPages(pool, keys, pages, in_place=in_place)
    pool.kv.zero_()  # the pages are free again: staging kept its own copy
    assert len(staged) == 3 and staged.nbytes == 3 * pool.bytes_per_page
    got = staged.encoded([2, 0])
    assert [k for k, _ in got] == [keys[2], keys[0]]
    ref = KVPool(tiny.arch, num_pages=7, page_size=4, dtype=dtype, device=torch.device("cpu"))
    ref.kv.copy_(torch.randn(ref.kv.shape, generator=torch.Generator().manual_seed(1)).to(dtype))
    for (key, block), page in zip(got, [pages[2], pages[0]], strict=True):
        arr, dt = to_block_array(ref.read_pages([page])[0])
        assert bytes(block) == encode_block(key, arr, dtype=dt, shape=arr.shape, layout=LAYOUT)
        assert decode_block(block).key == key  # the checksum verifies


def test_keys_and_pages_must_pair(tiny) -> None:
    pool = KVPool(tiny.arch, num_pages=3, page_size=4, dtype=torch.float32, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="2 keys for 1 pages"):
        StagedPages(pool, [BlockKey(b"a" * 8), BlockKey(b"b" * 8)], [0])
    with pytest.raises(ValueError, match="page index"):
        StagedPages(pool, [BlockKey(b"a" * 8)], [3])
    assert np.all(pool.kv.numpy() == 0)
