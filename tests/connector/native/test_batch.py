"""Batches of one-page blocks on several threads (connector/native_batch.py) give what the
single-block fallbacks give, bit for bit: pages out of order, a corrupted block in the middle
(only that page is refused), a time budget already spent (nothing is counted), bad arguments."""

from __future__ import annotations

import numpy as np
import pytest

from connector import native, native_batch
from kvstore.block import BlockHeader, encode_block, read_header

needs_native = pytest.mark.skipif(native.status().impl != "native",
                                  reason=f"native ops not built: {native.status().reason}")


@pytest.fixture(autouse=True)
def _threads_for_small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_batch, "THREAD_MIN_BYTES", 0)  # let the tests' small batches use threads


def _case(seed: int, n: int) -> tuple[np.ndarray, list[int], list[BlockHeader], list[memoryview], list[bytes]]:
    rng = np.random.default_rng(seed)
    layers, seg, num_pages = int(rng.integers(1, 6)), 4 * int(rng.integers(20, 300)), n + 5
    pool = rng.integers(0, 256, (layers, 2, num_pages, seg), dtype=np.uint8)
    pages = [int(p) for p in rng.permutation(num_pages)[:n]]
    blocks = [encode_block(b"b-%d-%d" % (seed, i), rng.integers(0, 256, (layers, 2, 1, seg), dtype=np.uint8))
              for i in range(n)]
    headers = [read_header(b) for b in blocks]
    return pool, pages, headers, [memoryview(b)[h.size :] for b, h in zip(blocks, headers, strict=True)], blocks


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("seed", range(6))
def test_unpack_many_equals_the_fallback(seed: int, threads: int) -> None:
    pool, pages, headers, payloads, _ = _case(seed, n=2 * seed + 1)
    got = [pool.copy() for _ in range(2)]
    res = [native_batch.unpack_verify_many(headers, payloads, g, pages, threads=threads, use_native=u)
           for g, u in zip(got, (None, False), strict=True)]
    assert res == [[True] * len(pages)] * 2
    assert np.array_equal(got[0], got[1])
    ref = pool.copy()
    for h, p, page in zip(headers, payloads, pages, strict=True):
        native.unpack_verify(h, p, ref, [page], use_native=False)
    assert np.array_equal(got[0], ref)


@pytest.mark.parametrize("use_native", [None, False], ids=["native", "fallback"])
def test_a_corrupted_block_fails_alone(use_native: bool | None) -> None:
    if use_native is None and native.status().impl != "native":
        pytest.skip(native.status().reason)
    pool, pages, headers, payloads, blocks = _case(40, n=7)
    bad = bytearray(blocks[3])
    bad[-1] ^= 0x10
    payloads[3] = memoryview(bad)[headers[3].size :]
    res = native_batch.unpack_verify_many(headers, payloads, pool, pages, threads=2, use_native=use_native)
    assert res == [True, True, True, False, True, True, True]


@needs_native
def test_a_spent_budget_counts_nothing() -> None:
    pool, pages, headers, payloads, _ = _case(41, n=5)
    before = pool.copy()
    res = native_batch.unpack_verify_many(headers, payloads, pool, pages, threads=2, budget_s=1e-9)
    assert res == [None] * 5  # not reached: neither verified nor refused
    assert np.array_equal(pool, before)


@pytest.mark.parametrize("threads", [1, 2])
def test_pack_many_equals_encode_block(threads: int) -> None:
    pool, pages, _, _, _ = _case(42, n=9)
    layers, _, _, seg = pool.shape
    blocks = [encode_block(b"p-%d" % p, np.ascontiguousarray(pool[:, :, [p]])) for p in pages]
    headers = [read_header(b) for b in blocks]
    for use_native in (None, False):
        outs = [np.empty(layers * 2 * seg, np.uint8) for _ in pages]
        sums = native_batch.pack_checksum_many([native.hashed_header(h.raw) for h in headers], pool, pages, outs,
                                               threads=threads, use_native=use_native)
        assert sums == [h.checksum for h in headers]
        assert [o.tobytes() for o in outs] == [b[h.size :] for b, h in zip(blocks, headers, strict=True)]


def test_bad_arguments_are_value_errors() -> None:
    pool, pages, headers, payloads, _ = _case(43, n=3)
    before = pool.copy()
    cases = {
        "lengths differ": (headers, payloads[:2], pages, 1),
        "duplicate page": (headers, payloads, [pages[0], pages[1], pages[0]], 1),
        "page out of range": (headers, payloads, [pages[0], pages[1], pool.shape[2]], 1),
        "short payload": (headers, [payloads[0], payloads[1], payloads[2][:-1]], pages, 1),
        "no threads": (headers, payloads, pages, 0),
        "header of another size": ([headers[0], headers[1], read_header(encode_block(b"x", np.zeros(8, np.uint8)))],
                                   payloads, pages, 1),
    }
    for what, (h, p, pg, t) in cases.items():
        with pytest.raises(ValueError):
            native_batch.unpack_verify_many(h, p, pool, pg, threads=t)
            pytest.fail(what)
    assert np.array_equal(pool, before)  # nothing moved
    with pytest.raises(ValueError, match="read-only"):
        native_batch.pack_checksum_many([b""], pool, [0], [bytes(pool[:, :, 0].size)])
    assert native_batch.unpack_verify_many([], [], pool, []) == []
