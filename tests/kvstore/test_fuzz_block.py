"""The block decoder fuzzed (bench/soak/fuzz.py): read_header, verify_payload and decode_block
raise BlockFormatError (or ChecksumError) on anything broken, and what they accept is usable."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from bench.soak.fuzz import check_block, fuzz_blocks
from bench.soak.fuzz_cases import rechecksum
from kvstore.block import _FIXED, decode_block, encode_block
from kvstore.errors import BlockFormatError


def test_decoder_fuzz_finds_nothing() -> None:
    tally = fuzz_blocks(600, seed=0)
    assert tally.total == 600
    assert tally.crashes == 0, tally.crash_cases[:3]


def _with_shape(shape: tuple[int, ...]) -> bytes:
    """A block of no bytes whose shape is rewritten to ``shape`` (same ndim), checksum made valid."""
    blk = bytearray(encode_block(b"k" * 16, np.zeros((1,) * (len(shape) - 1) + (0,), dtype=np.float32)))
    struct.pack_into(f"<{len(shape)}Q", blk, _FIXED.size, *shape)
    return rechecksum(blk)


@pytest.mark.parametrize("shape", [(2**40, 2**30, 0), (2**63, 0), (2**64 - 1, 2, 0)])
def test_a_shape_no_array_can_take_is_refused(shape: tuple[int, ...]) -> None:
    """Found by the fuzzer: an empty block with a huge shape decoded, then array() raised ValueError."""
    buf = _with_shape(shape)
    with pytest.raises(BlockFormatError, match="too large"):
        decode_block(buf)
    assert check_block(buf) is None
    with pytest.raises(BlockFormatError, match="too large"):
        encode_block(b"k" * 16, b"", dtype="f4", shape=shape)


def test_check_block_reports_what_the_decoder_must_not_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fuzzer's verdict can fail: with the guard off, the unusable block is reported."""
    good = encode_block(b"k" * 16, np.arange(6, dtype=np.float32).reshape(2, 3))
    assert check_block(good) is None
    assert check_block(b"\xff" * 100) is None  # refused as BlockFormatError: fine
    monkeypatch.setattr("kvstore.block.MAX_SPAN_BYTES", 2**200)
    assert "array() raised ValueError" in (check_block(_with_shape((2**40, 2**30, 0))) or "")
