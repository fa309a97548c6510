"""Every hash kernel the CPU has (scalar, AVX2, AVX-512: csrc/xxh3_copy.c) gives python-xxhash's
xxh3_64 bit for bit, over every length class the streaming code distinguishes and over copies cut
into segments that straddle its 64-byte stripes; a kernel that fails the self-test is never used."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from connector import native, native_lib
from kvstore.block import encode_block, read_header

needs_native = pytest.mark.skipif(native.status().impl != "native",
                                  reason=f"native ops not built: {native.status().reason}")
KERNELS = native_lib.supported_kernels()


@pytest.fixture(params=KERNELS or ["none"])
def kernel(request: pytest.FixtureRequest):
    if request.param == "none":
        pytest.skip("native ops not built")
    prev = native_lib.use_kernel(request.param)
    yield request.param
    native_lib.use_kernel(prev)


@needs_native
def test_the_best_kernel_is_picked_at_load() -> None:
    assert native_lib.kernel() == KERNELS[-1]  # supported_kernels lists them simplest first
    assert "scalar" in KERNELS


def test_hash_equals_xxhash_on_every_length_class(kernel: str) -> None:
    lib, _ = native_lib.load()
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, 70_000, dtype=np.uint8)
    lengths = [*range(241, 400), *(b * 1024 + d for b in (1, 2, 3, 16, 64) for d in (-65, -64, -1, 0, 1, 63, 64, 65))]
    lengths += [int(x) for x in rng.integers(241, 70_000, 40)]
    for n in lengths:
        assert native_lib.hash_bytes(lib, data[:n]) == xxhash.xxh3_64(data[:n]).intdigest(), n
    with pytest.raises(ValueError, match="too short"):
        native_lib.hash_bytes(lib, data[:240])


@pytest.mark.parametrize("seed", range(16))
def test_copies_in_odd_segments_equal_the_fallback(kernel: str, seed: int) -> None:
    """Segments of any size (a multiple of 1, 4 or 64 bytes), several pages, pages out of order:
    the native pack and unpack write the fallback's bytes and compute its checksum."""
    rng = np.random.default_rng(seed)
    layers, n, num_pages = int(rng.integers(1, 5)), int(rng.integers(1, 4)), 6
    seg = int(rng.choice([int(rng.integers(1, 300)), 4 * int(rng.integers(1, 200)), 64 * int(rng.integers(1, 40))]))
    pool = rng.integers(0, 256, (layers, 2, num_pages, seg), dtype=np.uint8)
    pages = [int(p) for p in rng.permutation(num_pages)[:n]]
    blk = encode_block(b"odd-%d" % seed, np.ascontiguousarray(pool[:, :, pages]))
    hdr = read_header(blk)
    outs = [np.empty(hdr.payload_len, np.uint8) for _ in range(2)]
    sums = [native.pack_checksum(native.hashed_header(hdr.raw), pool, pages, o, use_native=u)
            for o, u in zip(outs, (True, False), strict=True)]
    assert sums == [hdr.checksum] * 2 and outs[0].tobytes() == outs[1].tobytes() == blk[hdr.size :]
    targets = [int(p) for p in rng.permutation(num_pages)[:n]]
    got = [pool.copy() for _ in range(2)]
    for g, u in zip(got, (True, False), strict=True):
        native.unpack_verify(hdr, memoryview(blk)[hdr.size :], g, targets, use_native=u)
    assert np.array_equal(got[0], got[1])


def test_a_kernel_failing_its_self_test_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    if native.status().impl != "native":
        pytest.skip(native.status().reason)
    monkeypatch.setattr(native_lib, "_self_test", lambda lib: "hash of 241 bytes differs from python-xxhash")
    native_lib.load.cache_clear()
    try:
        st = native.status()
        assert st.impl == "fallback" and "self-test" in st.reason and "scalar:" in st.reason
        pool = np.zeros((1, 2, 2, 256), np.uint8)
        blk = encode_block(b"k", np.ones((1, 2, 1, 256), np.uint8))
        hdr = read_header(blk)
        native.unpack_verify(hdr, memoryview(blk)[hdr.size :], pool, [1])  # the fallback does the work
        assert pool[:, :, 1].all() and not pool[:, :, 0].any()
    finally:
        native_lib.load.cache_clear()


def test_only_a_kernel_the_cpu_has_can_be_chosen() -> None:
    if native.status().impl != "native":
        pytest.skip(native.status().reason)
    with pytest.raises(ValueError, match="not supported"):
        native_lib.use_kernel("sse9")
    assert native_lib.kernel() == KERNELS[-1]


@pytest.mark.parametrize("seed", range(6))
def test_batches_stream_blocks_in_pairs_like_the_fallback(kernel: str, seed: int) -> None:
    """Batches copy two blocks side by side when their headers are the same size (and one by one
    otherwise: keys of very different lengths here); both give the fallback's bytes and sums."""
    from connector import native_batch

    rng = np.random.default_rng(100 + seed)
    layers, seg, n = int(rng.integers(1, 5)), int(rng.choice([72, 260, 4096, 12288])), int(rng.integers(2, 9))
    pool = rng.integers(0, 256, (layers, 2, n + 3, seg), dtype=np.uint8)
    keys = [(b"k" * (1 + 150 * int(rng.integers(0, 2)))) + b"%d" % i for i in range(n)]
    blocks = [encode_block(k, rng.integers(0, 256, (layers, 2, 1, seg), dtype=np.uint8)) for k in keys]
    headers = [read_header(b) for b in blocks]
    payloads = [memoryview(b)[h.size :] for b, h in zip(blocks, headers, strict=True)]
    pages = [int(p) for p in rng.permutation(n + 3)[:n]]
    got = [pool.copy(), pool.copy()]
    for g, u in zip(got, (True, False), strict=True):
        assert native_batch.unpack_verify_many(headers, payloads, g, pages, threads=2, use_native=u) == [True] * n
    assert np.array_equal(got[0], got[1])
    prefixes = [native.hashed_header(h.raw) for h in headers]
    outs = [[np.empty(layers * 2 * seg, np.uint8) for _ in range(n)] for _ in range(2)]
    sums = [native_batch.pack_checksum_many(prefixes, got[0], pages, o, threads=2, use_native=u)
            for o, u in zip(outs, (True, False), strict=True)]
    assert sums[0] == sums[1] == [h.checksum for h in headers]
    assert all(a.tobytes() == b.tobytes() == bytes(p) for a, b, p in zip(*outs, payloads, strict=True))
