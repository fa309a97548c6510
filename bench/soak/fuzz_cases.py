"""Malformed inputs for the fuzzer (bench/soak/fuzz.py), as hypothesis strategies.

Three kinds per target, so that cases get past the first check as well as fail at it:
- structured: a well-typed message whose values are wild (boundary integers, empty and
  over-long keys, unknown sessions), built from the protobuf descriptor itself, so a field added
  to kvstore.proto is fuzzed with no change here;
- near-valid: a correct request (a real encoded block, its true size, chunks in order) with one
  thing wrong — a flipped byte, a wrong offset, a header field changed *and the checksum
  recomputed* (only that reaches the decoder's deeper checks);
- raw: arbitrary bytes, or the serialized form of a valid message truncated or bit-flipped, sent
  where the daemon expects a protobuf message or a stream-channel frame.
"""

from __future__ import annotations

import json
import struct
from typing import NamedTuple

import numpy as np
import xxhash
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

from kvstore.block import _CHECKSUM_OFFSET, _FIXED, encode_block
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server import stream_wire as w

EDGE_U64 = (0, 1, 2, 15, 16, 17, 63, 64, 65, 255, 256, 257, 4095, 4096, 4097, 65535, 65536, 2**31 - 1, 2**31,
            2**32 - 1, 2**32, 2**53, 2**63 - 1, 2**63, 2**64 - 1)  # fmt: skip
FIELD_MAX = {FieldDescriptor.TYPE_UINT32: 2**32 - 1, FieldDescriptor.TYPE_UINT64: 2**64 - 1,
             FieldDescriptor.TYPE_INT32: 2**31 - 1, FieldDescriptor.TYPE_INT64: 2**63 - 1}  # fmt: skip
DTYPES = ("<f4", "<f2", "|u1", "<i8", "|V2", "|O", "<c8", "f4", "", "\x00", "(2,)f4", "<U4", "S3", "M8[s]")


def edge_int(hi: int) -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([v for v in EDGE_U64 if v <= hi]), st.integers(0, hi))


def keys() -> st.SearchStrategy[bytes]:
    """Block keys: mostly plausible (16 bytes), with empty, 256/257-byte and long ones."""
    return st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=300),
                     st.sampled_from([b"", b"\x00", b"k" * 256, b"k" * 257, b"k" * 5000]))


def _field(f: FieldDescriptor, depth: int) -> st.SearchStrategy[object]:
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        one: st.SearchStrategy[object] = messages(f.message_type, depth + 1)
    elif f.type == FieldDescriptor.TYPE_BYTES:
        one = keys()
    elif f.type == FieldDescriptor.TYPE_STRING:
        one = st.one_of(st.text(max_size=40), st.sampled_from(["", "nope", "../../etc/passwd", "x" * 5000]))
    elif f.type == FieldDescriptor.TYPE_BOOL:
        one = st.booleans()
    elif f.type == FieldDescriptor.TYPE_ENUM:
        one = st.sampled_from([v.number for v in f.enum_type.values])
    else:
        one = edge_int(FIELD_MAX.get(f.type, 2**32 - 1))
    if f.is_repeated:
        return st.lists(one, max_size=8 if depth else 24)
    return one


@st.composite
def _message(draw: st.DrawFn, desc: Descriptor, depth: int) -> object:
    cls = getattr(pb, desc.name)
    if depth > 2:
        return cls()
    chosen = {o.fields[draw(st.integers(0, len(o.fields) - 1))].name for o in desc.oneofs}
    kw = {}
    for f in desc.fields:
        if f.containing_oneof is not None and f.name not in chosen:
            continue
        if draw(st.booleans()):
            kw[f.name] = draw(_field(f, depth))
    return cls(**kw)


def messages(desc: Descriptor, depth: int = 0) -> st.SearchStrategy[object]:
    """Any message of type ``desc`` with wild values in a random subset of its fields."""
    return _message(desc, depth)


def mutate(data: bytes) -> st.SearchStrategy[bytes]:
    """``data`` truncated, extended, or with a few bytes flipped."""
    n = len(data)
    flips = st.lists(st.tuples(st.integers(0, max(n - 1, 0)), st.integers(1, 255)), min_size=1, max_size=4)

    def flip(fs: list[tuple[int, int]]) -> bytes:
        b = bytearray(data)
        for i, x in fs:
            if b:
                b[i] ^= x
        return bytes(b)

    return st.one_of(st.integers(0, max(n - 1, 0)).map(lambda k: data[:k]),
                     st.binary(min_size=1, max_size=64).map(lambda tail: data + tail), flips.map(flip))


def raw_or_mutated(valid: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    return st.one_of(st.binary(max_size=512), valid.flatmap(mutate))


# -- blocks --------------------------------------------------------------------------------
def rechecksum(buf: bytearray) -> bytes:
    """Recompute a block's checksum after its header was changed (so the decoder's later checks run)."""
    if len(buf) < _FIXED.size:
        return bytes(buf)
    (_, _, ndim, dlen, klen, llen, plen, _) = _FIXED.unpack_from(buf)
    raw = _FIXED.size + 8 * ndim + dlen + klen + llen
    hsize = min((raw + 63) // 64 * 64, len(buf))
    header = bytearray(buf[:hsize])
    header[_CHECKSUM_OFFSET : _CHECKSUM_OFFSET + 8] = b"\0" * 8
    h = xxhash.xxh3_64(bytes(header))
    h.update(bytes(buf[hsize:]))
    struct.pack_into("<Q", buf, _CHECKSUM_OFFSET, h.intdigest())
    return bytes(buf)


@st.composite
def valid_blocks(draw: st.DrawFn, key: bytes | None = None) -> tuple[bytes, bytes]:
    """(key, a correctly encoded block) of a few dtypes and shapes."""
    k = key if key is not None else draw(st.binary(min_size=1, max_size=32))
    dtype = draw(st.sampled_from(["f4", "f2", "u1", "i8"]))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=4)))
    arr = np.arange(int(np.prod(shape, dtype=np.int64)), dtype=dtype).reshape(shape)
    return k, encode_block(k, arr, layout=draw(st.sampled_from(["", "L2PHD", "T"])))


@st.composite
def _header_edit(draw: st.DrawFn, blk: bytes) -> bytes:
    """A block whose fixed header (or shape/dtype string) was edited, its checksum made valid again."""
    b = bytearray(blk)
    fields = list(_FIXED.unpack_from(b))
    i = draw(st.integers(1, 6))  # version, ndim, dtype_len, key_len, layout_len, payload_len
    widths = (None, 16, 8, 8, 16, 16, 64)
    fields[i] = draw(edge_int(2 ** widths[i] - 1))
    _FIXED.pack_into(b, 0, *fields)
    if draw(st.booleans()) and len(b) > _FIXED.size + 8:  # and maybe a byte of shape/dtype/key
        j = draw(st.integers(_FIXED.size, min(len(b) - 1, 63)))
        b[j] = draw(st.integers(0, 255))
    if draw(st.booleans()):  # the dtype string replaced in place (same length when it fits)
        s = draw(st.sampled_from(DTYPES)).encode()
        ndim, dlen = fields[2], fields[3]
        off = _FIXED.size + 8 * min(ndim, 8)
        b[off : off + min(len(s), dlen)] = s[:dlen]
    return rechecksum(b)


def bad_blocks() -> st.SearchStrategy[bytes]:
    """What the decoder must refuse (or accept consistently): every kind of broken block."""
    good = valid_blocks().map(lambda kb: kb[1])
    return st.one_of(st.binary(max_size=256), good.flatmap(mutate), good.flatmap(_header_edit),
                     good.flatmap(lambda b: mutate(b).map(lambda m: rechecksum(bytearray(m)))))


# -- Put streams ---------------------------------------------------------------------------
class PutCase(NamedTuple):
    """A Put's messages (serialized) and what to write into the shared segment first
    ((offset, bytes): the blocks its shared-memory handles point at)."""

    messages: list[bytes]
    place: list[tuple[int, bytes]]


@st.composite
def put_streams(draw: st.DrawFn, session: str = "", seg_size: int = 0) -> PutCase:
    """Near-valid Puts (real blocks, a few things wrong), one in four wholly valid, or wild ones."""
    if draw(st.integers(0, 3)) == 0:
        msgs = draw(st.lists(messages(pb.PutRequest.DESCRIPTOR), max_size=6))
        return PutCase([m.SerializeToString() for m in msgs], [])
    clean = draw(st.integers(0, 3)) == 0

    def bad(one_in: int) -> bool:
        return not clean and draw(st.integers(0, one_in - 1)) == 0

    blocks = draw(st.lists(valid_blocks(), min_size=1, max_size=3))
    datas = [draw(st.one_of(mutate(b), _header_edit(b))) if bad(2) else b for _, b in blocks]
    specs = [pb.BlockSpec(key=draw(keys()) if bad(6) else k, size=draw(edge_int(2**64 - 1)) if bad(6) else len(d),
                          dtype=draw(st.sampled_from(DTYPES)) if bad(6) else "",
                          shape=draw(st.lists(edge_int(64), max_size=3)) if bad(6) else [])
             for (k, _), d in zip(blocks, datas, strict=True)]  # fmt: skip
    via_shm = bool(session) and draw(st.booleans())
    msgs = [pb.PutRequest(begin=pb.PutBegin(blocks=specs, shm_session=session if via_shm else ""))]
    refs, place, pos = [], [], 4096
    for i, d in enumerate(datas):
        if via_shm:
            off = draw(edge_int(2**64 - 1)) if bad(6) else pos
            if pos + len(d) <= seg_size:
                place.append((pos, d))
            refs.append(pb.ShmRef(index=draw(edge_int(2**32 - 1)) if bad(8) else i, offset=off, length=len(d)))
            pos += (len(d) + 63) // 64 * 64
            continue
        step = draw(st.sampled_from([7, 64, 1024, 1 << 20]))
        for off in range(0, len(d), step):
            idx = draw(edge_int(2**32 - 1)) if bad(10) else i
            o = draw(edge_int(2**64 - 1)) if bad(10) else off
            msgs.append(pb.PutRequest(chunk=pb.PutChunk(index=idx, offset=o, data=d[off : off + step])))
    ending = "commit" if clean else draw(st.sampled_from(["commit", "commit", "none", "begin", "chunk"]))
    if ending == "commit":
        msgs.append(pb.PutRequest(commit=pb.PutCommit(shm=refs)))
    elif ending == "begin":
        msgs.append(msgs[0])
    elif ending == "chunk":
        msgs.append(pb.PutRequest(chunk=pb.PutChunk(index=0, offset=0, data=b"x")))
    out = [m.SerializeToString() for m in msgs]
    if bad(5):  # one message's bytes broken
        j = draw(st.integers(0, len(out) - 1))
        out[j] = draw(mutate(out[j]))
    return PutCase(out, place)


# -- the raw stream channel ----------------------------------------------------------------
@st.composite
def stream_requests(draw: st.DrawFn, known: list[bytes]) -> tuple[bool, bytes]:
    """(send the issued token first?, the bytes that follow) for one stream-channel connection."""
    good_token = draw(st.integers(0, 5)) > 0
    ks = draw(st.lists(st.one_of(st.sampled_from(known), keys()), max_size=6))
    req = w.REQUEST.pack(w.MAGIC, len(ks)) + b"".join(struct.pack("!H", min(len(k), 65535)) + k[:65535] for k in ks)
    kind = draw(st.integers(0, 4))
    if kind == 0:
        body = req
    elif kind == 1:
        body = draw(mutate(req))
    elif kind == 2:  # a header that promises more than follows, or lies about a key's length
        body = w.REQUEST.pack(draw(st.sampled_from([w.MAGIC, b"TKG2", b"\0\0\0\0"])), draw(edge_int(2**32 - 1)))
        body += draw(st.binary(max_size=64))
    elif kind == 3:
        body = req + draw(mutate(req))  # a second request, broken
    else:
        body = draw(st.binary(max_size=256))
    return good_token, body


# -- the engine's HTTP API -----------------------------------------------------------------
def _json_values() -> st.SearchStrategy[object]:
    leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                     st.text(max_size=20))  # fmt: skip
    return st.recursive(leaf, lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c,
                                                                                           max_size=4)), max_leaves=12)


FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "stop_token_ids", "stream",
          "stream_options", "ignore_eos", "cache_salt", "prompt", "messages", "echo", "best_of", "logprobs",
          "blend_separator", "blend_ratio", "documents", "max_completion_tokens")  # fmt: skip


@st.composite
def http_bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """(path, body) for POST: broken JSON, wrong top-level types, wrong field types.

    Every body that might be valid asks for one token (``max_tokens`` 1 unless that field is
    the one made wrong), so accepted cases cost the server one decode step, not a long answer."""
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
    base: dict[str, object] = {"max_tokens": 1, "temperature": 0}
    base.update({"prompt": "Hello"} if path == "/v1/completions" else
                {"messages": [{"role": "user", "content": "Hello"}]})  # fmt: skip
    kind = draw(st.integers(0, 5))
    if kind == 0:  # one field of the wrong type or value
        name = draw(st.sampled_from(FIELDS))
        value = draw(_json_values())
        if name == "max_tokens" and isinstance(value, int) and not isinstance(value, bool) and 1 < value:
            value = -value  # never a long generation
        base[name] = value
        if name == "max_completion_tokens":
            base.pop("max_tokens")
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                base[name] = -value
        return path, json.dumps(base).encode()
    if kind == 1:  # valid JSON, wrong top level
        return path, json.dumps(draw(st.one_of(st.lists(_json_values(), max_size=3), st.text(), st.integers(),
                                               st.none()))).encode()  # fmt: skip
    if kind == 2:  # broken JSON
        return path, draw(mutate(json.dumps(base).encode()))
    if kind == 3:  # deep nesting, or a long array
        depth = draw(st.sampled_from([10, 1000, 100_000]))
        field = draw(st.sampled_from(["prompt", "messages", "stop", "stop_token_ids"]))
        return path, json.dumps({**base, field: None}).replace("null", "[" * depth + "]" * depth).encode()
    if kind == 4:  # messages with broken parts
        msgs = draw(st.lists(st.dictionaries(st.sampled_from(["role", "content", "name", "type", "text"]),
                                             _json_values(), max_size=3), max_size=3))  # fmt: skip
        return "/v1/chat/completions", json.dumps({**base, "messages": msgs}).encode()
    return path, draw(st.binary(max_size=300))
