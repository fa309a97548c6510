"""Shared memory never carries bytes the caller did not ask for.

A real daemon runs in-process (the real servicer and TieredStore over gRPC on loopback) with its
store wrapped so a test can hold a read past the client's deadline, or write into the client's
segment while a Put is being stored: the late writer the guards exist for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import grpc
import numpy as np
import pytest

from kvstore.block import encode_block
from kvstore.client import KVStoreClient
from kvstore.config import StoreConfig, TierConfig
from kvstore.errors import KVStoreTimeout
from kvstore.level import LevelOptions
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.retry import Retry
from kvstore.server import grpc_options
from kvstore.servicer import KVStoreServicer
from kvstore.shm import HEADER_BYTES
from kvstore.shm_sessions import ShmSessions
from kvstore.tiered_store import TieredStore
from tiers.cpu import CpuTier

FLOATS = 16 * 1024  # 64 KiB blocks
WAIT_S = 30  # generous bound on every wait: the box is busy


class WrappedStore:
    """The daemon's TieredStore, with hooks a test sets to act inside ``read`` and ``put``."""

    def __init__(self, inner: TieredStore) -> None:
        self.inner = inner
        self.on_read: Callable[[bytes], None] | None = None
        self.on_put: Callable[[bytes], None] | None = None
        self.reads: dict[bytes, int] = {}

    def read(self, key: bytes, sink: Callable[[memoryview], Any]) -> Any:
        self.reads[key] = self.reads.get(key, 0) + 1
        if self.on_read is not None:
            self.on_read(key)
        return self.inner.read(key, sink)

    def get(self, key: bytes) -> bytes | None:  # the streamed Get path
        return self.read(key, bytes)

    def put(self, key: bytes, value: Any) -> bool:
        if self.on_put is not None:
            self.on_put(key)
        return self.inner.put(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class SpyServicer(KVStoreServicer):
    """The real servicer, remembering the server-side context of each Get call."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.get_contexts: list[grpc.ServicerContext] = []

    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> Iterator[pb.GetResponse]:  # noqa: N802
        self.get_contexts.append(context)
        yield from super().Get(request, context)


class InProcessDaemon:
    def __init__(self, store: WrappedStore, sessions: ShmSessions, address: str, server: grpc.Server,
                 servicer: SpyServicer) -> None:  # fmt: skip
        self.store, self.sessions, self.address, self.server = store, sessions, address, server
        self.servicer = servicer


@contextmanager
def inprocess_daemon(sessions: ShmSessions | None = None, workers: int = 8, cpu_bytes: int = 64 * 1024**2,
                     lower: list | None = None) -> Iterator[InProcessDaemon]:  # fmt: skip
    """``lower``: (tier, LevelOptions) pairs below the cpu tier."""
    cfg = StoreConfig(tiers=(TierConfig("cpu", cpu_bytes),), listen="127.0.0.1:0", workers=workers)
    store = WrappedStore(TieredStore([(CpuTier(cpu_bytes), LevelOptions()), *(lower or [])]))
    sessions = ShmSessions() if sessions is None else sessions
    server = grpc.server(ThreadPoolExecutor(max_workers=workers), options=grpc_options(cfg))
    servicer = SpyServicer(store, cfg, sessions)  # type: ignore[arg-type]
    pb_grpc.add_KVStoreServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield InProcessDaemon(store, sessions, f"127.0.0.1:{port}", server, servicer)
    finally:
        server.stop(None).wait()
        sessions.close()
        store.inner.close(flush=False)


def block(name: str, fill: float) -> tuple[bytes, bytes]:
    key = name.encode().ljust(16, b"-")
    return key, encode_block(key, np.full(FLOATS, fill, dtype=np.float32), layout="T")


class Gate:
    """Holds a daemon read of one key until released; tells when that read has returned."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.entered, self.release, self.done = threading.Event(), threading.Event(), threading.Event()

    def __call__(self, key: bytes) -> None:
        if key == self.key:
            self.entered.set()
            assert self.release.wait(WAIT_S)

    def read(self, store: WrappedStore) -> Callable[[bytes, Callable[[memoryview], Any]], Any]:
        """``store.read`` for the gated key that signals ``done`` when it returns (or raises)."""
        inner = store.read

        def read(key: bytes, sink: Callable[[memoryview], Any]) -> Any:
            try:
                return inner(key, sink)
            finally:
                if key == self.key:
                    self.done.set()

        return read


PATHS = pytest.mark.parametrize("use_arena", [False, True], ids=["copied", "in-place"])


@PATHS
def test_late_write_never_reaches_the_next_call(use_arena: bool) -> None:
    """A get times out while the daemon still holds its block; the next get on the same client
    must return its own bytes, even when the late handler is released in the middle of it.
    The race is forced (not hoped for) in each of 50 rounds, on both paths: the daemon copying
    into the segment, and the daemon answering in place from its arena."""
    with inprocess_daemon() as d:
        c = KVStoreClient(d.address, deadline_s=WAIT_S, retry=Retry(attempts=1), use_shm=True, use_arena=use_arena)
        try:
            for r in range(50):
                slow, fast = block(f"slow-{r}", 1.0 + r), block(f"fast-{r}", -1.0 - r)
                assert c.put_many([slow, fast]) == [True, True]
                gate = Gate(slow[0])
                d.store.on_read = gate
                d.store.read = gate.read(d.store)  # type: ignore[method-assign]
                c.deadline_s = 0.3
                with pytest.raises(KVStoreTimeout):
                    c.read_many([slow[0]], lambda i, mv: None)
                assert gate.entered.is_set()
                c.deadline_s = WAIT_S
                got: list[bytes] = []

                def sink(i: int, mv: memoryview, gate: Gate = gate, got: list[bytes] = got) -> None:
                    gate.release.set()  # the late handler writes now, if it still can
                    assert gate.done.wait(WAIT_S)
                    got.append(bytes(mv))

                assert c.read_many([fast[0]], sink) == [True]
                assert got == [fast[1]], f"round {r}: the next call's bytes were overwritten"
                assert c.arena_active == use_arena
                del d.store.read
        finally:
            c.close()


def test_timed_out_segment_is_abandoned_not_reused() -> None:
    """The client side alone: a segment whose call failed never goes back to the pool, and the
    daemon is told to drop it."""
    with inprocess_daemon() as d:
        c = KVStoreClient(d.address, deadline_s=WAIT_S, retry=Retry(attempts=1), use_shm=True)
        try:
            slow = block("slow", 1.0)
            c.put_many([slow])
            (used,) = c._shm._free  # the one segment, idle
            gate = Gate(slow[0])
            d.store.on_read = gate
            c.deadline_s = 0.3
            with pytest.raises(KVStoreTimeout):
                c.get_many([slow[0]], copy=True)
            assert used not in c._shm._free and not c._shm._free
            gate.release.set()
            d.store.on_read = None
            c.deadline_s = WAIT_S
            assert c.get_many([slow[0]], copy=True) == [slow[1]]
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
        c = KVStoreClient(d.address, deadline_s=WAIT_S, use_shm=True, use_arena=use_arena)
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
        c = KVStoreClient(d.address, deadline_s=WAIT_S, use_shm=True)
        try:
            c.put_many([block("warm", 0.0)])
            seg, _ = c._shm._free[0]  # the segment the next put will use (LIFO)
            victim = block("victim", 3.0)

            def scribble(key: bytes) -> None:
                if key == victim[0]:
                    seg.buf[HEADER_BYTES : HEADER_BYTES + len(victim[1])] = b"\xab" * len(victim[1])

            d.store.on_put = scribble
            assert c.put_many([victim]) == [True]
            assert c.get_many([victim[0]], copy=True) == [victim[1]]
        finally:
            c.close()


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "stream"])
def test_held_call_does_not_stall_another_client(use_shm: bool) -> None:
    """The server runs independent clients' calls side by side: while one client's Get is held
    inside the daemon, another client's calls complete (the held one is released only after)."""
    with inprocess_daemon() as d:
        held, other = block("held", 1.0), block("other", 2.0)
        with KVStoreClient(d.address, use_shm=use_shm) as a, KVStoreClient(d.address, use_shm=use_shm) as b:
            a.put_many([held, other])
            gate = Gate(held[0])
            d.store.on_read = gate
            result: list[Any] = []
            t = threading.Thread(target=lambda: result.append(a.get(held[0], copy=True)))
            t.start()
            try:
                assert gate.entered.wait(WAIT_S)
                assert b.get(other[0], copy=True) == other[1]
                assert b.put_many([block("more", 3.0)]) == [True]
                assert b.lookup([held[0], other[0]]).prefix_len == 2
            finally:
                gate.release.set()
                t.join(WAIT_S)
            assert result == [held[1]]
