"""Gets without shared memory on the daemon's raw TCP channel (issue 11, the remote path).

Multi-MB blocks come back byte-identical and verified, from a real ``kvstore serve``; a deadline
mid-reply is KVStoreTimeout and the next call's bytes are its own; a daemon killed mid-reply is
KVStoreUnavailable; a daemon or port without the channel leaves Gets on gRPC streaming.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from bench.servers import free_port
from kvstore.block import decode_block
from kvstore.client.retry import ExponentialBackoff, Retry
from kvstore.client.stream_client import StreamChannel
from kvstore.errors import KVStoreError, KVStoreTimeout, KVStoreUnavailable
from tests.fixtures_kvstore import (
    MIB,
    WAIT_S,
    Daemon,
    Gate,
    big_block,
    connect,
    each,
    fetch,
    fetch_one,
    stream_daemon,
)

FAST = Retry(attempts=3, backoff=ExponentialBackoff(base_s=0.01, cap_s=0.01, jitter=False))


def test_multi_mb_blocks_come_back_identical_and_verified(tmp_path: Path, daemons: list[Daemon]) -> None:
    d = Daemon(tmp_path, "--cpu", "256MiB").start()
    daemons.append(d)
    blocks = [big_block(i) for i in range(6)]
    keys = [k for k, _ in blocks]
    with connect(d, deadline_s=WAIT_S, use_shm=False, use_stream=True) as c:
        assert c.put_many(blocks) == [True] * 6
        got = fetch(c, [keys[0], b"absent-key-00001", *keys[1:]])
        assert got[1] is None
        assert [bytes(g) for g in got[:1] + got[2:] if g is not None] == [v for _, v in blocks]
        for k, blk in zip(keys, c.get_blocks(keys), strict=True):  # checksum verified
            assert blk is not None and blk.key == k
        owned: dict[int, bytes] = {}

        def copy_then_verify(i: int, mv: memoryview) -> None:  # as connector/loader.py does
            owned[i] = bytes(mv)
            decode_block(owned[i], verify=True)

        assert c.read_batches(keys, each(copy_then_verify)) == [True] * 6
        assert [owned[i] for i in range(6)] == [v for _, v in blocks]
        assert c._stream.enabled and c._stream._idle  # the channel carried them, not gRPC


def test_daemon_without_the_channel_streams_over_grpc(tmp_path: Path, daemons: list[Daemon]) -> None:
    d = Daemon(tmp_path, "--cpu", "64MiB", "--no-stream").start()
    daemons.append(d)
    k, v = big_block(7, mib=2)
    with connect(d, deadline_s=WAIT_S, use_shm=False) as c:
        c.put(k, v)
        assert fetch_one(c, k) == v
        assert not c._stream._idle
    with connect(d, deadline_s=WAIT_S, use_shm=False, use_stream=True, retry=FAST) as c:
        with pytest.raises(KVStoreError, match="stream channel refused"):
            fetch_one(c, k)


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
        c = connect(d, deadline_s=WAIT_S, retry=Retry(attempts=1), use_shm=False, use_stream=True)
        try:
            c.put_many(blocks)
            (a, va), (b, _), (z, vz) = blocks
            gate = Gate(b)
            d.store.on_read = gate
            d.store.read = gate.read(d.store)  # type: ignore[method-assign]
            seen: list[int] = []
            c.deadline_s = 0.5
            with pytest.raises(KVStoreTimeout):
                c.read_batches([a, b, z], each(lambda i, mv: seen.append(i)))
            assert seen == [0] and gate.entered.is_set()  # it failed mid-reply
            gate.release.set()
            assert gate.done.wait(WAIT_S)  # the late reply was sent (or refused) by now
            d.store.on_read = None
            c.deadline_s = WAIT_S
            assert fetch(c, [z, a]) == [vz, va]
        finally:
            c.close()


def test_daemon_killed_mid_reply_is_unavailable(tmp_path: Path, daemons: list[Daemon]) -> None:
    d = Daemon(tmp_path, "--cpu", "256MiB").start()
    daemons.append(d)
    blocks = [big_block(i) for i in range(24)]  # 96 MiB: more than the socket buffers hold
    with connect(d, deadline_s=WAIT_S, use_shm=False, use_stream=True, retry=FAST) as c:
        for i in range(0, 24, 6):
            c.put_many(blocks[i : i + 6])
        seen: list[int] = []

        def kill_on_first(i: int, mv: memoryview) -> None:
            seen.append(i)
            if len(seen) == 1:
                d.kill(signal.SIGKILL)

        with pytest.raises(KVStoreUnavailable):
            c.read_batches([k for k, _ in blocks], each(kill_on_first))
        assert 0 < len(seen) < 24


def test_close_stops_the_accept_thread() -> None:
    """close() must wake the thread blocked in accept(): closing the socket alone does not on
    Linux, and every daemon stop then waited out a 5 s join."""
    from kvstore.server.stream_server import StreamServer

    srv = StreamServer(store=None, host="127.0.0.1", port=0)  # type: ignore[arg-type]
    srv.start()
    srv.close()
    assert not srv._thread.is_alive()
