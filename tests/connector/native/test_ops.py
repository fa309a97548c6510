"""The native data-path ops (csrc/) against their numpy fallbacks, bit for bit: random shapes,
odd page counts, strided pools, pages out of order, a corrupted byte, bad arguments."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from connector import native, native_lib
from kvstore.block import encode_block, read_header
from kvstore.errors import ChecksumError

needs_native = pytest.mark.skipif(native.status().impl != "native",
                                  reason=f"native ops not built: {native.status().reason}")


def _case(seed: int) -> tuple[np.ndarray, list[int], bytes]:
    """A pool [layers, 2, pages, seg] of random bytes, a page list out of order, and an encoded
    block of len(pages) pages with another random payload."""
    rng = np.random.default_rng(seed)
    layers, seg = int(rng.integers(1, 7)), int(rng.integers(1, 40)) * 8 + int(rng.integers(0, 2)) * 4
    num_pages = int(rng.integers(3, 12))
    n = int(rng.integers(1, num_pages + 1)) | 1  # odd page counts
    n = min(n, num_pages)
    pages = [int(p) for p in rng.permutation(num_pages)[:n]]
    pool = rng.integers(0, 256, (layers, 2, num_pages, seg), dtype=np.uint8)
    data = rng.integers(0, 256, (layers, 2, n, seg), dtype=np.uint8)
    return pool, pages, encode_block(b"blk-%04d" % seed, data, layout="LKPB")


def _unpack(pool: np.ndarray, blk: bytes, pages: list[int], use_native: bool) -> tuple[np.ndarray, str]:
    hdr = read_header(blk)
    try:
        native.unpack_verify(hdr, memoryview(blk)[hdr.size :], pool, pages, use_native=use_native)
    except ChecksumError:
        return pool, "checksum"
    return pool, ""


@needs_native
@pytest.mark.parametrize("seed", range(12))
def test_unpack_verify_equals_fallback(seed: int) -> None:
    pool, pages, blk = _case(seed)
    a, ra = _unpack(pool.copy(), blk, pages, use_native=True)
    b, rb = _unpack(pool.copy(), blk, pages, use_native=False)
    assert (ra, rb) == ("", "")
    assert np.array_equal(a, b)
    want = np.frombuffer(blk, np.uint8)[read_header(blk).size :].reshape(pool.shape[0], 2, len(pages), -1)
    assert np.array_equal(a[:, :, pages], want)
    others = [p for p in range(pool.shape[2]) if p not in pages]
    assert np.array_equal(a[:, :, others], pool[:, :, others])  # no other page touched


@needs_native
@pytest.mark.parametrize("seed", range(12))
def test_pack_checksum_equals_fallback_and_encode_block(seed: int) -> None:
    pool, pages, _ = _case(seed)
    blk = encode_block(b"pack", np.ascontiguousarray(pool[:, :, pages]))
    hdr = read_header(blk)
    prefix = native.hashed_header(hdr.raw)
    outs = [np.empty(hdr.payload_len, np.uint8) for _ in range(2)]
    got = [native.pack_checksum(prefix, pool, pages, o, use_native=u) for o, u in zip(outs, (True, False), strict=True)]
    assert got == [hdr.checksum, hdr.checksum]
    assert np.array_equal(outs[0], outs[1])
    assert outs[0].tobytes() == blk[hdr.size :]


@needs_native
@pytest.mark.parametrize("use_native", [True, False], ids=["native", "fallback"])
def test_strided_pool_and_non_contiguous_payload(use_native: bool) -> None:
    """A pool that is a view with gaps between pages (and a reversed layer axis), a payload
    given as a non-contiguous array: same bytes as the contiguous case."""
    pool, pages, blk = _case(99)
    big = np.zeros((pool.shape[0], 2, pool.shape[2] * 2, pool.shape[3]), np.uint8)
    view = big[::-1, :, ::2]
    view[:] = pool
    hdr = read_header(blk)
    payload = np.frombuffer(blk, np.uint8)[hdr.size :].reshape(pool.shape[0], 2, len(pages), -1)
    strided_payload = np.repeat(payload, 2, axis=3)[..., ::2]
    assert not strided_payload.flags.c_contiguous
    native.unpack_verify(hdr, strided_payload, view, pages, use_native=use_native)
    ref, _ = _unpack(pool.copy(), blk, pages, use_native=False)
    assert np.array_equal(view, ref)
    assert not big[:, :, 1::2].any()  # the gaps were never written
    out = np.empty(hdr.payload_len, np.uint8)
    assert native.pack_checksum(native.hashed_header(hdr.raw), view, pages, out, use_native=use_native) \
        == hdr.checksum


@needs_native
@pytest.mark.parametrize("use_native", [True, False], ids=["native", "fallback"])
@pytest.mark.parametrize("where", ["payload_first", "payload_last", "header"])
def test_a_corrupted_byte_is_a_checksum_error(use_native: bool, where: str) -> None:
    pool, pages, blk = _case(7)
    hdr = read_header(blk)
    bad = bytearray(blk)
    if where == "header":  # the header's padding: read_header does not look at it, the checksum does
        bad[hdr.size - 1] ^= 0x01
    else:
        bad[hdr.size if where == "payload_first" else len(bad) - 1] ^= 0x40
    with pytest.raises(ChecksumError):
        native.unpack_verify(read_header(bytes(bad)), memoryview(bad)[hdr.size :], pool.copy(), pages,
                             use_native=use_native)


@pytest.mark.parametrize("use_native", [None, False], ids=["auto", "fallback"])
def test_bad_arguments_are_value_errors(use_native: bool | None) -> None:
    pool, pages, blk = _case(0)
    assert len(pages) == 3
    hdr = read_header(blk)
    payload = memoryview(blk)[hdr.size :]
    cases = {
        "pages out of range": (pool, [pages[0], pages[1], pool.shape[2]]),
        "negative page": (pool, [-1, pages[1], pages[2]]),
        "duplicate page": (pool, [pages[0], pages[1], pages[0]]),
        "no pages": (pool, []),
        "float pages": (pool, [0.5]),
        "wrong dtype pool": (pool.view(np.int8), pages),
        "3-d pool": (pool[0], pages),
        "read-only pool": (np.frombuffer(pool.tobytes(), np.uint8).reshape(pool.shape), pages),
    }
    for what, (p, pg) in cases.items():
        with pytest.raises(ValueError):
            native.unpack_verify(hdr, payload, p, pg, use_native=use_native)
            pytest.fail(what)
    with pytest.raises(ValueError, match="bytes"):  # a truncated payload
        native.unpack_verify(hdr, payload[:-1], pool, pages, use_native=use_native)
    with pytest.raises(ValueError, match="header says"):  # consistent with the pages, not the header
        native.unpack_verify(hdr, payload[: len(payload) // 3], pool, pages[:1], use_native=use_native)
    out = np.empty(hdr.payload_len, np.uint8)
    with pytest.raises(ValueError, match="bytes"):
        native.pack_checksum(b"", pool, pages, out[:-1], use_native=use_native)
    with pytest.raises(ValueError, match="read-only"):
        native.pack_checksum(b"", pool, pages, bytes(hdr.payload_len), use_native=use_native)
    with pytest.raises(ValueError, match="contiguous"):
        native.pack_checksum(b"", pool, pages, np.empty(hdr.payload_len * 2, np.uint8)[::2], use_native=use_native)


def test_status_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    from prometheus_client import CollectorRegistry

    caplog.set_level(logging.INFO, logger="connector.native")
    st = native.log_status()
    assert st.impl in ("native", "fallback")
    assert ("native" if st.impl == "native" else "fallback") in caplog.text
    reg = CollectorRegistry()
    native.info_gauge(reg)
    assert reg.get_sample_value("tierkv_native_info", {"impl": st.impl, "reason": st.reason}) == 1.0


def test_without_the_extension_the_fallback_runs_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(native_lib, "_library_path", lambda: None)
    native_lib.load.cache_clear()
    try:
        st = native.log_status()
        assert st == native.NativeStatus("fallback", "extension not built (no C compiler at install time?)")
        assert "numpy fallback" in caplog.text
        pool, pages, blk = _case(5)
        ref, _ = _unpack(pool.copy(), blk, pages, use_native=False)
        got, res = _unpack(pool, blk, pages, use_native=None)
        assert res == "" and np.array_equal(got, ref)
        with pytest.raises(RuntimeError, match="unavailable"):
            _unpack(pool, blk, pages, use_native=True)
    finally:
        native_lib.load.cache_clear()


@pytest.mark.parametrize("use_native", [True, False], ids=["native", "fallback"])
def test_what_is_verified_is_what_landed(use_native: bool) -> None:
    """Copy first, verify the copy. The payload aliases the pool so that copying K overwrites the
    source of V before V is read: an op that verified the source and then copied it would accept
    the block and leave K twice in the pool. The invariant either way: the op raises, or the
    pool holds exactly the block's bytes."""
    if use_native and native.status().impl != "native":
        pytest.skip(native.status().reason)
    seg = 4096
    rng = np.random.default_rng(11)
    data = rng.integers(0, 256, (1, 2, 1, seg), dtype=np.uint8)
    blk = encode_block(b"alias", data)
    hdr = read_header(blk)
    mem = np.zeros(3 * seg, np.uint8)
    mem[: 2 * seg] = data.reshape(-1)
    payload, pool = mem[: 2 * seg], mem[seg:].reshape(1, 2, 1, seg)
    try:
        native.unpack_verify(hdr, payload, pool, [0], use_native=use_native)
    except ChecksumError:
        assert use_native  # the native op copies K over V's source, then hashes what landed
        return
    assert np.array_equal(pool, data)


def test_connector_metrics_name_the_active_implementation() -> None:
    from connector import native
    from connector.metrics import ConnectorMetrics

    m = ConnectorMetrics()
    st = native.status()
    assert m.value("tierkv_native_info", impl=st.impl, reason=st.reason) == 1.0


@pytest.mark.parametrize("use_native", [True, False])
def test_pieces_apart_scatter_verify_and_gather_checksum(use_native: bool) -> None:
    """A block copied to and from pieces that lie apart (one tensor per layer, as vLLM allocates
    them): the same bytes and the same checksum as a block encoded in one piece, on both paths;
    a payload changed after encoding is caught over what landed."""
    from kvstore.block import encode_block, read_header

    rng = np.random.default_rng(7)
    seg = 1000  # not a multiple of a stripe: pieces straddle stripes
    layers = [np.zeros((6, seg), np.uint8) for _ in range(5)]
    payload = rng.integers(0, 256, (5, seg), dtype=np.uint8)
    blk = encode_block(b"key-apart", payload)
    hdr = read_header(blk)
    addrs = np.array([a.ctypes.data + 4 * seg for a in layers], np.uint64)
    native.scatter_verify(hdr, memoryview(blk)[hdr.size :], addrs, seg, use_native=use_native)
    assert all(np.array_equal(layers[i][4], payload[i]) for i in range(5))
    assert all(not layers[i][3].any() for i in range(5))
    out = bytearray(5 * seg)
    assert native.gather_checksum(native.hashed_header(hdr.raw), addrs, seg, out, use_native=use_native) == hdr.checksum
    assert bytes(out) == payload.tobytes()
    bad = bytearray(blk)
    bad[-3] ^= 0x40
    with pytest.raises(ChecksumError):
        native.scatter_verify(hdr, memoryview(bad)[hdr.size :], addrs, seg, use_native=use_native)
    with pytest.raises(ValueError, match="pieces of"):
        native.scatter_verify(hdr, memoryview(blk)[hdr.size :], addrs[:4], seg, use_native=use_native)
