"""The data path with a CUDA KV pool equals its host fallbacks (needs CUDA; bench/gpu_check.sh
runs these): blocks loaded from a daemon through pinned staging land on the GPU bit for bit,
pages offloaded from the GPU encode bit for bit, and the torch re-rotation on the GPU agrees
with the native host op within a stated tolerance (the GPU's kernels may fuse multiply-adds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from connector import native_rope
from connector.dtypes import to_block_array
from connector.loader import Loader
from connector.staging import LAYOUT, StagedPages
from engine.kv_pool import KVPool
from engine.rope import Rotary
from kvstore.block import encode_block
from kvstore.keys import BlockKey
from tests.fixtures_kvstore import WAIT_S, connect, inprocess_daemon

pytestmark = pytest.mark.gpu
ROPE_RTOL = 1e-5  # of max |K|, fp32


@pytest.mark.parametrize("use_arena", [True, False], ids=["in-place", "copied"])
def test_load_into_a_gpu_pool_is_bit_for_bit(tiny, use_arena: bool) -> None:
    pool = KVPool(tiny.arch, num_pages=80, page_size=4, dtype=torch.float32, device=torch.device("cuda"))
    rng = np.random.default_rng(8)
    keys = [BlockKey(b"gpu-%012d" % i) for i in range(70)]  # more than one staging round
    arrays = [rng.standard_normal(pool.block_shape()).astype(np.float32) for _ in keys]
    pages = [int(p) for p in rng.permutation(80)[:70]]
    with inprocess_daemon() as d, connect(d, use_arena=use_arena) as c:
        c.put_many([(k, encode_block(k, a, layout=LAYOUT)) for k, a in zip(keys, arrays, strict=True)])
        res = Loader(c, pool, chunk_bytes=8 * pool.bytes_per_page).load(keys, pages, deadline_s=WAIT_S)
    assert (res.pages_ok, res.failure) == (70, "")
    got = pool.read_pages(pages).numpy()
    assert np.array_equal(got, np.stack(arrays))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offload_from_a_gpu_pool_encodes_bit_for_bit(tiny, dtype: torch.dtype) -> None:
    pool = KVPool(tiny.arch, num_pages=9, page_size=4, dtype=dtype, device=torch.device("cuda"))
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(2)).to(dtype))
    pages = [7, 1, 4]
    keys = [BlockKey(b"gpu-off-%08d" % p) for p in pages]
    staged = StagedPages(pool, keys, pages)
    for (key, block), page in zip(staged.encoded([0, 1, 2]), pages, strict=True):
        arr, dt = to_block_array(pool.read_pages([page])[0])
        assert bytes(block) == encode_block(key, arr, dtype=dt, shape=arr.shape, layout=LAYOUT)


def test_gpu_rerotation_agrees_with_the_native_host_op() -> None:
    g = torch.Generator().manual_seed(4)
    k = torch.randn(4, 300, 3, 64, generator=g) * 4
    rotary = Rotary(64, 10000.0, 8192)
    new = torch.arange(300)
    cos_o, sin_o = rotary.cos_sin(new + 1000)
    cos_n, sin_n = rotary.cos_sin(new)
    tables = (cos_o, -sin_o, cos_n, sin_n)
    host = native_rope.rerotate(k.clone(), tables)
    on_gpu = native_rope.rerotate(k.cuda(), tuple(t.cuda() for t in tables))  # torch: not on the host
    assert on_gpu.device.type == "cuda"
    err = float((on_gpu.cpu() - host).abs().max()) / float(host.abs().max())
    assert err <= ROPE_RTOL
