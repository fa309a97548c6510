"""Self-describing binary format of one KV block.

Why self-describing: blocks outlive the process that wrote them (disk, S3, Redis), and are read
by engines that may disagree about the model. Each block carries its key, dtype, shape and
layout, and a checksum, so a reader can refuse a corrupted or mismatched block instead of
feeding garbage KV into attention.

Layout (little endian)::

    fixed header  <4s H B B H H Q Q>   magic, version, ndim, dtype_len, key_len, layout_len,
                                       payload_len, checksum
    shape         ndim x u64
    dtype         dtype_len bytes (numpy dtype string, e.g. "<f2")
    key           key_len bytes
    layout        layout_len bytes (utf-8, e.g. "LTHD" = layer, k/v, token, head*dim)
    padding       zeros up to a multiple of 64 bytes, so the payload is aligned for numpy
    payload       payload_len bytes of raw tensor data

The checksum is xxh3_64 over the header (with the checksum field zeroed) followed by the
payload, so corruption of either is detected. Decoding never copies the payload: it returns a
memoryview (and a numpy view) into the buffer it was given.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from math import prod
from typing import NamedTuple

import numpy as np
import xxhash

from kvstore.errors import BlockFormatError, ChecksumError

MAGIC = b"TKVB"
VERSION = 1
ALIGN = 64
_FIXED = struct.Struct("<4sHBBHHQQ")
_CHECKSUM_OFFSET = _FIXED.size - 8
MAX_NDIM = 8
MAX_KEY_LEN = 256
MAX_LAYOUT_LEN = 64
#: bound on the bytes a shape may span counting its zero dimensions as 1: a shape such as
#: (2**40, 2**30, 0) holds no bytes yet no array can take it (numpy refuses it in reshape)
MAX_SPAN_BYTES = 2**62
#: dtypes a KV block may hold; anything else is refused (object dtypes would be unsafe)
ALLOWED_DTYPES = frozenset(
    np.dtype(d).str for d in ("f2", "f4", "f8", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8")
) | {np.dtype("V2").str}  # raw 16-bit (bfloat16 carried as opaque 2-byte words)

Payload = bytes | bytearray | memoryview | np.ndarray


@dataclass(frozen=True)
class Block:
    """A decoded block. ``payload`` is a view into the buffer passed to ``decode_block``."""

    key: bytes
    dtype: np.dtype
    shape: tuple[int, ...]
    layout: str
    payload: memoryview

    def array(self) -> np.ndarray:
        """The payload as a numpy array (a view, no copy; read-only if the buffer is)."""
        return np.frombuffer(self.payload, dtype=self.dtype).reshape(self.shape)

    @property
    def nbytes(self) -> int:
        return self.payload.nbytes


def _norm_dtype(dtype: np.dtype | str) -> np.dtype:
    if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
        return np.dtype("V2")
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError, SyntaxError) as e:
        raise BlockFormatError(f"unknown dtype {dtype!r}") from e
    if dt.str not in ALLOWED_DTYPES:
        raise BlockFormatError(f"dtype {dt.str!r} not allowed in a KV block")
    return dt


def _check_span(shape: tuple[int, ...], itemsize: int) -> None:
    if prod(max(s, 1) for s in shape) * itemsize >= MAX_SPAN_BYTES:
        raise BlockFormatError(f"shape {shape} is too large for any array")


def header_size(key_len: int, ndim: int, dtype_len: int, layout_len: int) -> int:
    raw = _FIXED.size + 8 * ndim + dtype_len + key_len + layout_len
    return (raw + ALIGN - 1) // ALIGN * ALIGN


def _as_bytes_view(payload: Payload) -> memoryview:
    if isinstance(payload, np.ndarray):
        if not payload.flags.c_contiguous:
            payload = np.ascontiguousarray(payload)
        return memoryview(payload.reshape(-1).view(np.uint8))
    return memoryview(payload).cast("B")


def encode_header(key: bytes, dtype: np.dtype | str, shape: tuple[int, ...], layout: str, payload_len: int) -> bytes:
    """The header of a block (padding included) with its checksum field zero: the bytes its
    checksum starts with. ``payload_len`` must match ``shape`` x ``dtype``."""
    dt = _norm_dtype(dtype)
    shape = tuple(int(s) for s in shape)
    if len(shape) > MAX_NDIM or any(s < 0 for s in shape):
        raise BlockFormatError(f"bad shape {shape}")
    _check_span(shape, dt.itemsize)
    if not key or len(key) > MAX_KEY_LEN:
        raise BlockFormatError(f"key length {len(key)} outside 1..{MAX_KEY_LEN}")
    lay = layout.encode()
    if len(lay) > MAX_LAYOUT_LEN:
        raise BlockFormatError(f"layout longer than {MAX_LAYOUT_LEN} bytes")
    if payload_len != prod(shape) * dt.itemsize:
        raise BlockFormatError(
            f"payload of {payload_len} bytes does not match shape {shape} x {dt.itemsize} bytes"
        )
    dts = dt.str.encode()
    out = bytearray(header_size(len(key), len(shape), len(dts), len(lay)))
    _FIXED.pack_into(out, 0, MAGIC, VERSION, len(shape), len(dts), len(key), len(lay), payload_len, 0)
    off = _FIXED.size
    for s in shape:
        struct.pack_into("<Q", out, off, s)
        off += 8
    for part in (dts, key, lay):
        out[off : off + len(part)] = part
        off += len(part)
    return bytes(out)


def set_checksum(block: bytearray | memoryview, checksum: int) -> None:
    """Write ``checksum`` into the header of ``block`` (built from ``encode_header``)."""
    struct.pack_into("<Q", block, _CHECKSUM_OFFSET, checksum)


def encode_block(
    key: bytes,
    data: Payload,
    dtype: np.dtype | str | None = None,
    shape: tuple[int, ...] | None = None,
    layout: str = "",
) -> bytes:
    """Encode one block. ``dtype``/``shape`` default to those of ``data`` when it is an ndarray."""
    if isinstance(data, np.ndarray):
        dtype = data.dtype if dtype is None else dtype
        shape = tuple(data.shape) if shape is None else shape
    if dtype is None or shape is None:
        raise BlockFormatError("dtype and shape are required for raw bytes payloads")
    dt = _norm_dtype(dtype)  # before viewing the data: object arrays have no bytes to view
    view = _as_bytes_view(data)
    header = encode_header(key, dt, shape, layout, view.nbytes)
    hsize = len(header)
    out = bytearray(hsize + view.nbytes)
    out[:hsize] = header
    out[hsize:] = view
    h = xxhash.xxh3_64(header)
    h.update(view)
    set_checksum(out, h.intdigest())
    return bytes(out)


class BlockHeader(NamedTuple):
    """A block's header, parsed from a private copy of its bytes (``raw``)."""

    raw: bytes
    key: bytes
    dtype: str  # numpy dtype string as written, not yet checked against ALLOWED_DTYPES
    shape: tuple[int, ...]
    layout: str
    payload_len: int
    checksum: int

    @property
    def size(self) -> int:
        return len(self.raw)


def read_header(buf: bytes | bytearray | memoryview) -> BlockHeader:
    """Copy and parse the header of the encoded block ``buf`` (whose length must match it).

    The header is copied before it is parsed, so a buffer that others can write (shared memory)
    cannot change it between the checks and the use; check the payload with ``verify_payload``.
    """
    mv = memoryview(buf).cast("B") if not isinstance(buf, bytes) else memoryview(buf)
    if mv.nbytes < _FIXED.size:
        raise BlockFormatError(f"truncated block: {mv.nbytes} bytes < header")
    _, _, ndim, dlen, klen, llen, _, _ = _FIXED.unpack_from(bytes(mv[: _FIXED.size]))
    raw = bytes(mv[: header_size(klen, ndim, dlen, llen)])
    magic, version, ndim, dlen, klen, llen, plen, checksum = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise BlockFormatError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise BlockFormatError(f"unsupported block format version {version}")
    if ndim > MAX_NDIM or klen == 0 or klen > MAX_KEY_LEN or llen > MAX_LAYOUT_LEN or dlen > 16:
        raise BlockFormatError("corrupt header fields")
    hsize = header_size(klen, ndim, dlen, llen)
    if hsize != len(raw) or mv.nbytes != hsize + plen:
        raise BlockFormatError(f"block of {mv.nbytes} bytes, header says {hsize + plen}")
    off = _FIXED.size
    shape = struct.unpack_from(f"<{ndim}Q", raw, off)
    off += 8 * ndim
    dts = raw[off : off + dlen].decode("ascii", errors="replace")
    off += dlen
    key = raw[off : off + klen]
    off += klen
    layout = raw[off : off + llen].decode("utf-8", errors="replace")
    return BlockHeader(raw, key, dts, tuple(shape), layout, plen, checksum)


def verify_payload(header: BlockHeader, parts: Iterable[Payload]) -> None:
    """Raise ChecksumError unless ``parts`` (the payload, in order, possibly in pieces such as a
    KV pool page's per-layer slices) match the header's checksum."""
    raw = header.raw
    h = xxhash.xxh3_64(raw[:_CHECKSUM_OFFSET] + b"\0" * 8 + raw[_FIXED.size :])
    for p in parts:
        h.update(p)
    if h.intdigest() != header.checksum:
        raise ChecksumError(f"checksum mismatch for block {header.key.hex()[:16]}")


def decode_block(buf: bytes | bytearray | memoryview, verify: bool = True) -> Block:
    """Parse ``buf`` into a Block whose payload is a view of ``buf`` (zero copy).

    Raises BlockFormatError for a malformed/truncated block, ChecksumError for corruption.
    """
    mv = memoryview(buf).cast("B") if not isinstance(buf, bytes) else memoryview(buf)
    hdr = read_header(mv)
    payload = mv[hdr.size :]
    if verify:
        verify_payload(hdr, [payload])
    dt = _norm_dtype(hdr.dtype)
    _check_span(hdr.shape, dt.itemsize)
    if hdr.payload_len != prod(hdr.shape) * dt.itemsize:
        raise BlockFormatError(f"payload {hdr.payload_len} bytes != shape {hdr.shape} x {dt.itemsize}")
    return Block(key=hdr.key, dtype=dt, shape=hdr.shape, layout=hdr.layout, payload=payload)


def peek_key(buf: bytes | bytearray | memoryview) -> bytes:
    """The key of an encoded block, without verifying the checksum."""
    return decode_block(buf, verify=False).key


def block_fault(buf: bytes | bytearray | memoryview, key: bytes) -> str | None:
    """Why ``buf`` cannot be served as the block stored under ``key``, or None when it can.

    The reasons are short labels (used as a metric label): ``checksum`` (bytes corrupted),
    ``format`` (not a block, or truncated) and ``key`` (a valid block of another key).
    """
    try:
        blk = decode_block(buf)
    except ChecksumError:
        return "checksum"
    except BlockFormatError:
        return "format"
    return None if blk.key == bytes(key) else "key"
