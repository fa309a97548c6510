"""Bad input to the daemon: each case gets a clear gRPC status, nothing is stored, and blocks
stored before are still intact afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvstore.block import encode_block
from kvstore.client.client import KVStoreClient
from kvstore.client.shm import HEADER_BYTES
from kvstore.errors import ChecksumError, InvalidRequest, ResourceExhausted
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.server.auth import ClientAuth
from tests.fixtures_kvstore import Daemon, connect, fetch, fetch_one

GOOD_KEY = b"good-key-0000001"


def _enc(key: bytes, n: int = 1024, dtype: str = "f4") -> bytes:
    return encode_block(key, np.arange(n, dtype=dtype), layout="T")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("bad")
    d = Daemon(tmp, "--cpu", "16MiB", "--disk", f"{tmp}/disk:64MiB",
               env={"TIERKV_MAX_BLOCK_BYTES": "1MiB", "TIERKV_MAX_MESSAGE_BYTES": "2MiB",
                    "TIERKV_CHUNK_BYTES": "1MiB"}).start()  # fmt: skip
    with connect(d) as c:
        assert c.put(GOOD_KEY, _enc(GOOD_KEY))
    yield d
    d.stop()


@pytest.fixture(params=[True, False], ids=["shm", "stream"])
def client(daemon: Daemon, request: pytest.FixtureRequest) -> Iterator[KVStoreClient]:
    with connect(daemon, deadline_s=10, use_shm=request.param, chunk_bytes=512 * 1024) as c:
        yield c
    with connect(daemon) as c:  # nothing lost, whatever the test sent
        assert fetch_one(c, GOOD_KEY) == _enc(GOOD_KEY)


def _absent(c: KVStoreClient, *keys: bytes) -> None:
    assert c.lookup(list(keys)).tiers == [None] * len(keys)


def test_unknown_keys_miss(client: KVStoreClient) -> None:
    assert fetch(client, [b"nope-1", b"nope-2"]) == [None, None]
    assert client.lookup([b"nope-1", GOOD_KEY]) == (0, [None, "cpu"], [None, None], None)
    assert client.delete([b"nope-1"]) == 0


def test_bad_checksum_rejects_whole_batch(client: KVStoreClient) -> None:
    k1, k2 = b"batch-ok-0000001", b"batch-bad-000001"
    bad = bytearray(_enc(k2))
    bad[-5] ^= 0xFF
    with pytest.raises(ChecksumError, match="block 1"):
        client.put_many([(k1, _enc(k1)), (k2, bytes(bad))])
    _absent(client, k1, k2)


def test_malformed_and_mismatched_blocks(client: KVStoreClient) -> None:
    k = b"malformed-000001"
    with pytest.raises(InvalidRequest, match="magic"):
        client.put(k, b"\x00" * 4096)
    with pytest.raises(InvalidRequest, match="truncated|header says"):
        client.put(k, _enc(k)[:-10])
    with pytest.raises(InvalidRequest, match="key inside the block"):
        client.put(k, _enc(b"another-key-0001"))
    with pytest.raises(InvalidRequest, match="dtype"):
        client.put_many([(k, _enc(k, dtype="f2"))], dtype="<f4")
    with pytest.raises(InvalidRequest, match="shape"):
        client.put_many([(k, _enc(k, n=1000))], shape=(1024,))
    assert client.put_many([(k, _enc(k))], dtype="<f4", shape=(1024,)) == [True]  # matching: stored
    assert client.delete([k]) == 1
    with pytest.raises(InvalidRequest, match="length"):
        client.lookup([b""])


def test_oversize_block(client: KVStoreClient) -> None:
    k = b"oversize-0000001"
    with pytest.raises(ResourceExhausted, match="block limit"):
        client.put(k, _enc(k, n=400 * 1024))  # 1.6 MB > TIERKV_MAX_BLOCK_BYTES=1MiB
    _absent(client, k)


def _raw(daemon: Daemon) -> tuple[grpc.Channel, pb_grpc.KVStoreStub]:
    ch = ClientAuth.from_env().channel(daemon.address, [("grpc.max_send_message_length", 64 << 20)])
    return ch, pb_grpc.KVStoreStub(ch)


def test_protocol_violations(daemon: Daemon) -> None:
    ch, stub = _raw(daemon)
    k = b"protocol-0000001"
    blk = _enc(k)
    spec = pb.BlockSpec(key=k, size=len(blk))
    cases = {
        "no begin": ([pb.PutRequest(commit=pb.PutCommit())], grpc.StatusCode.INVALID_ARGUMENT),
        "no commit": ([pb.PutRequest(begin=pb.PutBegin(blocks=[spec])),
                       pb.PutRequest(chunk=pb.PutChunk(index=0, offset=0, data=blk))], grpc.StatusCode.ABORTED),
        "short": ([pb.PutRequest(begin=pb.PutBegin(blocks=[spec])),
                   pb.PutRequest(chunk=pb.PutChunk(index=0, offset=0, data=blk[:100])),
                   pb.PutRequest(commit=pb.PutCommit())], grpc.StatusCode.INVALID_ARGUMENT),
        "chunk out of bounds": ([pb.PutRequest(begin=pb.PutBegin(blocks=[spec])),
                                 pb.PutRequest(chunk=pb.PutChunk(index=3, offset=0, data=blk))],
                                grpc.StatusCode.INVALID_ARGUMENT),
        "oversize message": ([pb.PutRequest(begin=pb.PutBegin(blocks=[spec])),
                              pb.PutRequest(chunk=pb.PutChunk(index=0, offset=0, data=b"x" * (3 << 20)))],
                             grpc.StatusCode.RESOURCE_EXHAUSTED),
        "unknown shm session": ([pb.PutRequest(begin=pb.PutBegin(blocks=[spec], shm_session="nope")),
                                 pb.PutRequest(commit=pb.PutCommit(shm=[pb.ShmRef(index=0, offset=HEADER_BYTES,
                                                                                   length=len(blk))]))],
                                grpc.StatusCode.FAILED_PRECONDITION),
        "huge batch": ([pb.PutRequest(begin=pb.PutBegin(blocks=[pb.BlockSpec(key=b"k%d" % i, size=1 << 20)
                                                                for i in range(2000)]))],
                       grpc.StatusCode.RESOURCE_EXHAUSTED),
    }  # fmt: skip
    for name, (msgs, code) in cases.items():
        with pytest.raises(grpc.RpcError) as ei:
            stub.Put(iter(msgs), timeout=10)
        assert ei.value.code() == code, (name, ei.value.code(), ei.value.details())
        assert ei.value.details(), name
    with pytest.raises(grpc.RpcError) as ei:
        list(stub.Get(pb.GetRequest(keys=[k], shm_session="nope"), timeout=10))
    assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert stub.Lookup(pb.LookupRequest(keys=[k]), timeout=10).tiers == [""]
    ch.close()


def test_bad_shm_range(daemon: Daemon) -> None:
    with connect(daemon, use_shm=True) as c:
        c.lookup([GOOD_KEY])
        fetch_one(c, GOOD_KEY)  # attaches a segment
        seg, session = c._shm._free[0]
        k = b"shm-range-000001"
        blk = _enc(k)
        msgs = [pb.PutRequest(begin=pb.PutBegin(blocks=[pb.BlockSpec(key=k, size=len(blk))], shm_session=session)),
                pb.PutRequest(commit=pb.PutCommit(shm=[pb.ShmRef(index=0, offset=seg.size - 10,
                                                                 length=len(blk))]))]  # fmt: skip
        with pytest.raises(grpc.RpcError) as ei:
            c._stub.Put(iter(msgs), timeout=10)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside segment" in (ei.value.details() or "")
        with pytest.raises(grpc.RpcError) as ei:
            list(c._stub.Get(pb.GetRequest(keys=[k], shm_session=session, shm_offset=0, shm_length=10), timeout=10))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        _absent(c, k)


def test_impossible_segment_sizes_refused(daemon: Daemon, tmp_path: Path) -> None:
    """No segment is this small or this large: refused at AttachShm, in one line, no ticket."""
    ch, stub = _raw(daemon)
    for size in (0, HEADER_BYTES, 2**64 - 1):
        r = stub.AttachShm(pb.AttachShmRequest(size=size, by_fd=True), timeout=10)
        assert not r.ok and r.reason and "\n" not in r.reason and not r.ticket
    ch.close()


def test_a_client_from_before_the_socket_is_refused_and_streams(daemon: Daemon) -> None:
    """A client that attached by /dev/shm name (fields 1, 3, 4: reserved now) would take ok=True
    for a session id it never got, and fail its Puts: it is refused, so it streams."""
    ch, stub = _raw(daemon)
    name = b"tierkv-0123456789abcdef"
    old = (b"\x0a" + bytes([len(name)]) + name + pb.AttachShmRequest(size=1 << 20).SerializeToString()
           + b"\x1a\x10" + b"x" * 16 + b"\x20\x01")  # name, size, token, pid as such a client sent them
    r = stub.AttachShm(pb.AttachShmRequest.FromString(old), timeout=10)
    assert not r.ok and "update the client" in r.reason and not r.ticket
    ch.close()
