"""What the daemon-limit tests share (no tests here): stalled Put streams, a raw Lookup, a Put's status."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import numpy as np

from kvstore.block import encode_block
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc

WAIT_S = 30.0  # generous: a limit that works answers in well under a second


def blk(key: bytes) -> bytes:
    return encode_block(key, np.zeros(4096, dtype=np.uint8))


def settings(**fields: object) -> dict[str, str]:
    """``TIERKV_<FIELD>`` variables setting these StoreConfig fields."""
    return {f"TIERKV_{k.upper()}": str(v) for k, v in fields.items()}


class StalledPuts:
    """Put streams that send their begin and every byte, then no commit, until ``release``."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.KVStoreStub(self.channel)
        self.release = threading.Event()
        self.calls: list[grpc.Future] = []

    def open(self, key: bytes) -> grpc.Future:
        data = blk(key)

        def messages() -> Iterator[pb.PutRequest]:
            yield pb.PutRequest(begin=pb.PutBegin(blocks=[pb.BlockSpec(key=key, size=len(data))]))
            yield pb.PutRequest(chunk=pb.PutChunk(index=0, offset=0, data=data))
            self.release.wait()  # never commits while the test runs

        fut = self.stub.Put.future(messages())
        self.calls.append(fut)
        return fut

    def close(self) -> None:
        self.release.set()
        for f in self.calls:
            f.cancel()
        self.channel.close()


def lookup(address: str, keys: list[bytes], timeout: float = WAIT_S) -> pb.LookupResponse:
    with grpc.insecure_channel(address) as ch:
        return pb_grpc.KVStoreStub(ch).Lookup(pb.LookupRequest(keys=keys), timeout=timeout)


def code(fut: grpc.Future) -> grpc.StatusCode:
    err = fut.exception(timeout=WAIT_S)
    assert err is not None, "the call succeeded"
    return err.code()
