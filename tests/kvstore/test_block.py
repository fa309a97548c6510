"""Block format: round trip, zero copy, corruption / truncation / wrong magic or version."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from kvstore.block import ALIGN, MAGIC, decode_block, encode_block, peek_key
from kvstore.errors import BlockFormatError, ChecksumError

KEY = bytes(range(16))


def _arr() -> np.ndarray:
    return np.arange(2 * 2 * 4 * 8, dtype=np.float16).reshape(2, 2, 4, 8)


def test_round_trip_zero_copy() -> None:
    a = _arr()
    buf = encode_block(KEY, a, layout="LKTD")
    blk = decode_block(buf)
    assert blk.key == KEY and blk.shape == a.shape and blk.dtype == a.dtype and blk.layout == "LKTD"
    out = blk.array()
    np.testing.assert_array_equal(out, a)
    assert np.shares_memory(out, np.frombuffer(buf, dtype=np.uint8))  # a view, not a copy
    assert (len(buf) - blk.nbytes) % ALIGN == 0
    assert out.ctypes.data % 16 == 0 or isinstance(buf, bytes)
    assert peek_key(buf) == KEY


def test_raw_bytes_and_bfloat16() -> None:
    raw = bytes(range(256)) * 4
    buf = encode_block(KEY, raw, dtype="bfloat16", shape=(2, 256))
    blk = decode_block(bytearray(buf))
    assert bytes(blk.payload) == raw and blk.dtype.itemsize == 2


@pytest.mark.parametrize("where", ["payload", "header_shape", "key"])
def test_corruption_detected(where: str) -> None:
    buf = bytearray(encode_block(KEY, _arr()))
    pos = {"payload": len(buf) - 3, "header_shape": 32, "key": 32 + 4 * 8 + 3 + 2}[where]
    buf[pos] ^= 0x40
    with pytest.raises(BlockFormatError):  # ChecksumError is a BlockFormatError
        decode_block(buf)


def test_payload_flip_is_checksum_error() -> None:
    buf = bytearray(encode_block(KEY, _arr()))
    buf[-1] ^= 1
    with pytest.raises(ChecksumError):
        decode_block(buf)
    decode_block(buf, verify=False)  # still parseable without verification


@pytest.mark.parametrize("cut", [0, 5, 31, 100, -1])
def test_truncation(cut: int) -> None:
    buf = encode_block(KEY, _arr())
    with pytest.raises(BlockFormatError):
        decode_block(buf[:cut])


def test_wrong_magic_and_version() -> None:
    buf = bytearray(encode_block(KEY, _arr()))
    bad = bytearray(buf)
    bad[:4] = b"NOPE"
    with pytest.raises(BlockFormatError, match="magic"):
        decode_block(bad)
    bad = bytearray(buf)
    struct.pack_into("<H", bad, len(MAGIC), 99)
    with pytest.raises(BlockFormatError, match="version"):
        decode_block(bad)


def test_encode_rejects_inconsistent_input() -> None:
    with pytest.raises(BlockFormatError):
        encode_block(KEY, b"\0" * 10, dtype="f4", shape=(3,))
    with pytest.raises(BlockFormatError):
        encode_block(KEY, np.array(["a"], dtype=object))
    with pytest.raises(BlockFormatError):
        encode_block(b"", _arr())


def test_block_fault_names_the_reason() -> None:
    from kvstore.block import block_fault

    enc = encode_block(KEY, _arr(), layout="LTHD")
    assert block_fault(enc, KEY) is None
    bad = bytearray(enc)
    bad[-1] ^= 0xFF
    assert block_fault(bad, KEY) == "checksum"
    assert block_fault(enc[:-8], KEY) == "format" and block_fault(b"not a block", KEY) == "format"
    assert block_fault(enc, bytes(16)) == "key"
