"""Gets without shared memory on the daemon's raw TCP channel (issue 11, the remote path).

Multi-MB blocks come back byte-identical and verified, from a real ``kvstore serve``; a deadline
mid-reply is KVStoreTimeout and the next call's bytes are its own; a daemon killed mid-reply is
KVStoreUnavailable; a daemon or port without the channel leaves Gets on gRPC streaming.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest

from bench.servers import free_port
from kvstore.block import decode_block, encode_block
from kvstore.client import KVStoreClient
from kvstore.config import StoreConfig, TierConfig
from kvstore.errors import KVStoreError, KVStoreTimeout, KVStoreUnavailable
from kvstore.level import LevelOptions
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.retry import ExponentialBackoff, Retry
from kvstore.server import grpc_options
from kvstore.servicer import KVStoreServicer
from kvstore.shm_sessions import ShmSessions
from kvstore.stream_client import StreamChannel
from kvstore.stream_server import StreamServer
from kvstore.tiered_store import TieredStore
from tests.test_kvstore_daemon import Daemon
from tests.test_shm_safety import WAIT_S, Gate, InProcessDaemon, WrappedStore
from tiers.cpu import CpuTier

MIB = 1024**2
FAST = Retry(attempts=3, backoff=ExponentialBackoff(base_s=0.01, cap_s=0.01, jitter=False))


class StreamDaemon(InProcessDaemon):
    streams: StreamServer


@pytest.fixture
def daemons() -> Iterator[list[Daemon]]:
    made: list[Daemon] = []
    yield made
    for d in made:
        d.stop()


@contextmanager
def stream_daemon(**stream_opts: float) -> Iterator[StreamDaemon]:
    """The real servicer, store and stream channel in-process, the store wrapped for Gates."""
    cfg = StoreConfig(tiers=(TierConfig("cpu", 256 * MIB),), listen="127.0.0.1:0")
    store = WrappedStore(TieredStore([(CpuTier(256 * MIB), LevelOptions())]))
    sessions = ShmSessions()
    streams = StreamServer(store, "127.0.0.1", **stream_opts)  # type: ignore[arg-type]
    server = grpc.server(ThreadPoolExecutor(max_workers=8), options=grpc_options(cfg))
    servicer = KVStoreServicer(store, cfg, sessions, streams)  # type: ignore[arg-type]
    pb_grpc.add_KVStoreServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    streams.start()
    d = StreamDaemon(store, sessions, f"127.0.0.1:{port}", server, servicer)  # type: ignore[arg-type]
    d.streams = streams
    try:
        yield d
    finally:
        streams.close()
        server.stop(None).wait()
        sessions.close()
        store.inner.close(flush=False)


def big_block(i: int, mib: int = 4) -> tuple[bytes, bytes]:
    key = b"big-%012d" % i
    rng = np.random.default_rng(i)
    payload = rng.integers(0, 2**31, size=mib * MIB // 4 - 64, dtype=np.int32).view(np.float32)
    return key, encode_block(key, payload, layout="T")


def test_multi_mb_blocks_come_back_identical_and_verified(tmp_path: Path, daemons: list[Daemon]) -> None:
    d = Daemon(tmp_path, "--cpu", "256MiB").start()
    daemons.append(d)
    blocks = [big_block(i) for i in range(6)]
    keys = [k for k, _ in blocks]
    with KVStoreClient(d.address, deadline_s=WAIT_S, use_shm=False, use_stream=True) as c:
        assert c.put_many(blocks) == [True] * 6
        got = c.get_many([keys[0], b"absent-key-00001", *keys[1:]])
        assert got[1] is None
        assert [bytes(g) for g in got[:1] + got[2:] if g is not None] == [v for _, v in blocks]
        for k, blk in zip(keys, c.get_blocks(keys), strict=True):  # checksum verified
            assert blk is not None and blk.key == k
        owned: dict[int, bytes] = {}

        def copy_then_verify(i: int, mv: memoryview) -> None:  # as connector/loader.py does
            owned[i] = bytes(mv)
            decode_block(owned[i], verify=True)

        assert c.read_many(keys, copy_then_verify) == [True] * 6
        assert [owned[i] for i in range(6)] == [v for _, v in blocks]
        assert c._stream.enabled and c._stream._idle  # the channel carried them, not gRPC


def test_daemon_without_the_channel_streams_over_grpc(tmp_path: Path, daemons: list[Daemon]) -> None:
    d = Daemon(tmp_path, "--cpu", "64MiB", "--no-stream").start()
    daemons.append(d)
    k, v = big_block(7, mib=2)
    with KVStoreClient(d.address, deadline_s=WAIT_S, use_shm=False) as c:
        c.put(k, v)
        assert bytes(c.get(k)) == v  # type: ignore[arg-type]
        assert not c._stream._idle
    with KVStoreClient(d.address, deadline_s=WAIT_S, use_shm=False, use_stream=True, retry=FAST) as c:
        with pytest.raises(KVStoreError, match="stream channel refused"):
            c.get(k)


def test_unreachable_channel_port_falls_back_for_good() -> None:
    port = free_port()
    ch = StreamChannel("127.0.0.1", lambda: (port, b"t" * 32), max_block_bytes=MIB)
    assert ch.get([b"k"], lambda i, mv: None, timeout=WAIT_S) is False
    assert not ch.enabled


def test_deadline_mid_reply_is_timeout_and_next_call_is_intact() -> None:
    """The daemon holds the second of three blocks past the deadline, then sends the rest into
    the connection the client gave up on: the next call must read only its own reply."""
    with stream_daemon() as d:
        blocks = [big_block(i, mib=2) for i in range(3)]
        c = KVStoreClient(d.address, deadline_s=WAIT_S, retry=Retry(attempts=1), use_shm=False, use_stream=True)
        try:
            c.put_many(blocks)
            (a, va), (b, _), (z, vz) = blocks
            gate = Gate(b)
            d.store.on_read = gate
            d.store.read = gate.read(d.store)  # type: ignore[method-assign]
            seen: list[int] = []
            c.deadline_s = 0.5
            with pytest.raises(KVStoreTimeout):
                c.read_many([a, b, z], lambda i, mv: seen.append(i))
            assert seen == [0] and gate.entered.is_set()  # it failed mid-reply
            gate.release.set()
            assert gate.done.wait(WAIT_S)  # the late reply was sent (or refused) by now
            d.store.on_read = None
            c.deadline_s = WAIT_S
            assert [bytes(g) for g in c.get_many([z, a]) if g is not None] == [vz, va]
        finally:
            c.close()


def test_daemon_killed_mid_reply_is_unavailable(tmp_path: Path, daemons: list[Daemon]) -> None:
    d = Daemon(tmp_path, "--cpu", "256MiB").start()
    daemons.append(d)
    blocks = [big_block(i) for i in range(24)]  # 96 MiB: more than the socket buffers hold
    with KVStoreClient(d.address, deadline_s=WAIT_S, use_shm=False, use_stream=True, retry=FAST) as c:
        for i in range(0, 24, 6):
            c.put_many(blocks[i : i + 6])
        seen: list[int] = []

        def kill_on_first(i: int, mv: memoryview) -> None:
            seen.append(i)
            if len(seen) == 1:
                d.kill(signal.SIGKILL)

        with pytest.raises(KVStoreUnavailable):
            c.read_many([k for k, _ in blocks], kill_on_first)
        assert 0 < len(seen) < 24


def test_close_stops_the_accept_thread() -> None:
    """close() must wake the thread blocked in accept(): closing the socket alone does not on
    Linux, and every daemon stop then waited out a 5 s join."""
    from kvstore.stream_server import StreamServer

    srv = StreamServer(store=None, host="127.0.0.1", port=0)  # type: ignore[arg-type]
    srv.start()
    srv.close()
    assert not srv._thread.is_alive()
