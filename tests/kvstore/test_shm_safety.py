"""Shared memory never carries bytes the caller did not ask for.

A real daemon runs in-process (the real servicer and TieredStore over gRPC on loopback) with its
store wrapped so a test can hold a read past the client's deadline, or write into the client's
segment while a Put is being stored: the late writer the guards exist for.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import numpy as np
import pytest

from kvstore.client.retry import Retry
from kvstore.client.shm import HEADER_BYTES
from kvstore.errors import KVStoreTimeout
from kvstore.proto import kvstore_pb2 as pb
from tests.fixtures_kvstore import WAIT_S, Gate, block, connect, each, fetch, fetch_one, inprocess_daemon

PATHS = pytest.mark.parametrize("use_arena", [False, True], ids=["copied", "in-place"])


@PATHS
def test_late_write_never_reaches_the_next_call(use_arena: bool) -> None:
    """A get times out while the daemon still holds its block; the next get on the same client
    must return its own bytes, even when the late handler is released in the middle of it.
    The race is forced (not hoped for) in each of 12 rounds, on both paths: the daemon copying
    into the segment, and the daemon answering in place from its arena."""
    with inprocess_daemon() as d:
        c = connect(d, deadline_s=WAIT_S, retry=Retry(attempts=1), use_shm=True, use_arena=use_arena)
        try:
            for r in range(12):
                slow, fast = block(f"slow-{r}", 1.0 + r), block(f"fast-{r}", -1.0 - r)
                assert c.put_many([slow, fast]) == [True, True]
                gate = Gate(slow[0])
                d.store.on_read = gate
                d.store.read = gate.read(d.store)  # type: ignore[method-assign]
                c.deadline_s = 0.3
                with pytest.raises(KVStoreTimeout):
                    c.read_batches([slow[0]], lambda items: None)
                assert gate.entered.is_set()
                c.deadline_s = WAIT_S
                got: list[bytes] = []

                def sink(i: int, mv: memoryview, gate: Gate = gate, got: list[bytes] = got) -> None:
                    gate.release.set()  # the late handler writes now, if it still can
                    assert gate.done.wait(WAIT_S)
                    got.append(bytes(mv))

                assert c.read_batches([fast[0]], each(sink)) == [True]
                assert got == [fast[1]], f"round {r}: the next call's bytes were overwritten"
                assert c.arena_active == use_arena
                del d.store.read
        finally:
            c.close()


def test_timed_out_segment_is_abandoned_not_reused() -> None:
    """The client side alone: a segment whose call failed never goes back to the pool, and the
    daemon is told to drop it."""
    with inprocess_daemon() as d:
        c = connect(d, deadline_s=WAIT_S, retry=Retry(attempts=1), use_shm=True)
        try:
            slow = block("slow", 1.0)
            c.put_many([slow])
            (used,) = c._shm._free  # the one segment, idle
            gate = Gate(slow[0])
            d.store.on_read = gate
            c.deadline_s = 0.3
            with pytest.raises(KVStoreTimeout):
                fetch(c, [slow[0]])
            assert used not in c._shm._free and not c._shm._free
            gate.release.set()
            d.store.on_read = None
            c.deadline_s = WAIT_S
            assert fetch(c, [slow[0]]) == [slow[1]]
            assert c._shm._free and c._shm._free[0][1] != used[1]  # a fresh session
            deadline = time.monotonic() + WAIT_S  # the abandoned session is detached (async)
            while len(d.sessions) != 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(d.sessions) == 1
        finally:
            c.close()


@PATHS
def test_daemon_writes_nothing_for_a_client_that_gave_up(use_arena: bool) -> None:
    """The daemon side alone: a raw call (no client-side abandon) times out while its read is
    held; released once the daemon has seen the call end, the handler must not write into the
    segment, nor keep a lease (pinned blocks) for it."""
    with inprocess_daemon() as d:
        c = connect(d, deadline_s=WAIT_S, use_shm=True, use_arena=use_arena)
        try:
            slow = block("slow", 7.0)
            c.put_many([slow])
            seg, sid = c._shm._free[0]
            seg.buf[HEADER_BYTES : HEADER_BYTES + len(slow[1])] = b"\0" * len(slow[1])
            gate = Gate(slow[0])
            d.store.on_read = gate
            d.store.read = gate.read(d.store)  # type: ignore[method-assign]
            req = pb.GetRequest(keys=[slow[0]], shm_session=sid, shm_offset=HEADER_BYTES,
                                shm_length=seg.size - HEADER_BYTES, arena=use_arena)  # fmt: skip
            with pytest.raises(grpc.RpcError) as ei:
                list(c._stub.Get(req, timeout=0.3))
            assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            # The server's deadline starts when the call reaches it, so on a busy box it ends a
            # little after the client's; the guard is about what the daemon does once it knows.
            # (The window before it knows is what the client-side abandon, above, covers.)
            (ctx,) = d.servicer.get_contexts
            deadline = time.monotonic() + WAIT_S
            while ctx.is_active() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert not ctx.is_active()
            gate.release.set()
            assert gate.done.wait(WAIT_S)
            written = np.frombuffer(seg.buf[HEADER_BYTES : HEADER_BYTES + len(slow[1])], dtype=np.uint8)
            assert int(np.count_nonzero(written)) == 0, "the daemon wrote into a segment its client gave up on"
            assert d.sessions.leased() == 0, "the daemon pinned blocks for a client that gave up"
        finally:
            c.close()


def test_put_stores_the_daemons_own_copy() -> None:
    """The client writes into its segment after the daemon validated a Put (as an abandoned
    call's next user would): what is stored is what was validated."""
    with inprocess_daemon() as d:
        c = connect(d, deadline_s=WAIT_S, use_shm=True)
        try:
            c.put_many([block("warm", 0.0)])
            seg, _ = c._shm._free[0]  # the segment the next put will use (LIFO)
            victim = block("victim", 3.0)

            def scribble(key: bytes) -> None:
                if key == victim[0]:
                    seg.buf[HEADER_BYTES : HEADER_BYTES + len(victim[1])] = b"\xab" * len(victim[1])

            d.store.on_put = scribble
            assert c.put_many([victim]) == [True]
            assert fetch(c, [victim[0]]) == [victim[1]]
        finally:
            c.close()


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "stream"])
def test_held_call_does_not_stall_another_client(use_shm: bool) -> None:
    """The server runs independent clients' calls side by side: while one client's Get is held
    inside the daemon, another client's calls complete (the held one is released only after)."""
    with inprocess_daemon() as d:
        held, other = block("held", 1.0), block("other", 2.0)
        with connect(d, use_shm=use_shm) as a, connect(d, use_shm=use_shm) as b:
            a.put_many([held, other])
            gate = Gate(held[0])
            d.store.on_read = gate
            result: list[Any] = []
            t = threading.Thread(target=lambda: result.append(fetch_one(a, held[0])))
            t.start()
            try:
                assert gate.entered.wait(WAIT_S)
                assert fetch_one(b, other[0]) == other[1]
                assert b.put_many([block("more", 3.0)]) == [True]
                assert b.lookup([held[0], other[0]]).prefix_len == 2
            finally:
                gate.release.set()
                t.join(WAIT_S)
            assert result == [held[1]]
