"""Daemons and clients for tests: every kvstore daemon a test starts, and every client it opens,
comes from here.

Three kinds of daemon, from the most real to the most controllable:

- ``Daemon`` / ``daemon(tmp, *flags)``: ``kvstore serve`` as a subprocess on a free loopback port
  (what production runs); the ``daemons`` fixture stops every one a test appended.
- ``served(tmp, *flags)``: the daemon's own ``kvstore.server.daemon.Daemon`` in this process, configured
  from the same flags (``--listen 127.0.0.1:0`` first; ``TIERKV_CACHE_DIR`` is ``tmp``).
- ``inprocess_daemon()`` / ``stream_daemon()``: the real servicer and TieredStore over gRPC on
  loopback, the store wrapped (``WrappedStore``) so a test can act inside a read or a put
  (``Gate`` holds a read until released).

``connect(target, **options)`` is the one place a test builds a ``KVStoreClient``: ``target`` is
an address or anything with ``.address`` (each kind of daemon above); the options are the
client's own, passed through unchanged. ``fetch(c, keys)`` / ``fetch_one(c, key)`` read blocks'
bytes through the client's one read path (``read_batches``); ``each(sink)`` turns a per-block
``sink(i, view)`` into a ``read_batches`` consumer.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from bench.servers import spawn_daemon
from kvstore.block import encode_block
from kvstore.client.client import KVStoreClient
from kvstore.client.shm import SEGMENT_PREFIX
from kvstore.config.store_config import StoreConfig, TierConfig, load_config
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.server.credentials import Access
from kvstore.server.daemon import Daemon as ServedDaemon
from kvstore.server.daemon import grpc_options
from kvstore.server.servicer import KVStoreServicer
from kvstore.server.shm_listener import ShmListener
from kvstore.server.shm_sessions import ShmSessions
from kvstore.server.stream_server import StreamServer
from kvstore.store.tier_bookkeeping import LevelOptions
from kvstore.store.tiered_store import TieredStore
from tiers.cpu import CpuTier

FLOATS = 16 * 1024  # 64 KiB blocks
WAIT_S = 30  # generous bound on every wait: the box is busy
MIB = 1024**2


def connect(target: Any, **options: Any) -> KVStoreClient:
    """A client of ``target`` (an address, or a daemon of any kind here), with the client's own options."""
    return KVStoreClient(target if isinstance(target, str) else target.address, **options)


def each(sink: Callable[[int, memoryview], object]) -> Callable[[list[tuple[int, memoryview]]], None]:
    """A ``read_batches`` consumer that calls ``sink(i, view)`` for each block of a round."""

    def consume(items: list[tuple[int, memoryview]]) -> None:
        for i, mv in items:
            sink(i, mv)

    return consume


def fetch(c: KVStoreClient, keys: Sequence[bytes]) -> list[bytes | None]:
    """The blocks' bytes (None for a miss), in the order of ``keys``: ``read_batches``, each view
    copied out while it is valid."""
    out: list[bytes | None] = [None] * len(keys)
    c.read_batches(list(keys), each(lambda i, mv: out.__setitem__(i, bytes(mv))))
    return out


def fetch_one(c: KVStoreClient, key: bytes) -> bytes | None:
    return fetch(c, [key])[0]


def segments_mapped(pid: int) -> set[str]:
    """The clients' shared-memory segments (memfd names) process ``pid`` maps (its /proc/PID/maps):
    the sessions a daemon attached, seen from outside it."""
    return set(re.findall(rf"/memfd:({SEGMENT_PREFIX}[0-9a-f]+)", Path(f"/proc/{pid}/maps").read_text()))


def mapped_segments(pid: int) -> int:
    """How many clients' shared-memory segments process ``pid`` maps."""
    return len(segments_mapped(pid))


# -- kvstore serve, a subprocess --------------------------------------------------------------


class Daemon:
    def __init__(self, workdir: Path, *flags: str, env: dict[str, str] | None = None) -> None:
        self.workdir, self.flags, self.env = workdir, flags, env or {}
        self.log = workdir / "daemon.log"
        self.proc: subprocess.Popen[str] | None = None
        self.address = ""

    def start(self, listen: str = "127.0.0.1:0") -> Daemon:
        self.proc, self.address = spawn_daemon(self.workdir / "cache", *self.flags, env=self.env,
                                               log_path=self.log, listen=listen, timeout_s=30)
        return self

    def kill(self, sig: int = signal.SIGKILL) -> int:
        assert self.proc is not None
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=60)
        self.proc = None
        return rc

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill(signal.SIGTERM)


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[list[Daemon]]:
    made: list[Daemon] = []
    yield made
    for d in made:
        d.stop()


@contextmanager
def daemon(tmp: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[Daemon]:
    work = tmp / f"daemon-{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True)
    d = Daemon(work, *flags, env=env).start()
    try:
        yield d
    finally:
        d.stop()


# -- the daemon in this process ---------------------------------------------------------------


@contextmanager
def served(tmp: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[ServedDaemon]:
    """``kvstore.server.daemon.Daemon`` configured from ``flags`` (after ``--listen 127.0.0.1:0``) and ``env``
    (over ``TIERKV_CACHE_DIR=tmp``)."""
    d = ServedDaemon(load_config(["--listen", "127.0.0.1:0", *flags], env={"TIERKV_CACHE_DIR": str(tmp), **(env or {})}))
    d.start()
    try:
        yield d
    finally:
        d.stop()


# -- the servicer and store in this process, the store wrapped --------------------------------


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
def shm_listener(sessions: ShmSessions, servicer: KVStoreServicer) -> Iterator[ShmListener]:
    """The daemon's unix socket for ``sessions`` (in a fresh directory), serving until the end."""
    where = Path(tempfile.mkdtemp(prefix="tierkv-shm-"))
    listener = ShmListener(sessions, where / "shm.sock", servicer.arena_share)
    listener.start()
    try:
        yield listener
    finally:
        listener.close()
        shutil.rmtree(where, ignore_errors=True)


@contextmanager
def inprocess_daemon(sessions: ShmSessions | None = None, workers: int = 8, cpu_bytes: int = 64 * 1024**2,
                     lower: list | None = None, access: Access | None = None) -> Iterator[InProcessDaemon]:  # fmt: skip
    """``lower``: (tier, LevelOptions) pairs below the cpu tier; ``access``: the daemon's credentials
    (None: no auth, every caller admin). No auth interceptor: a call with an unknown token is
    refused by the servicer itself (UNAUTHENTICATED)."""
    cfg = StoreConfig(tiers=(TierConfig("cpu", cpu_bytes),), listen="127.0.0.1:0", workers=workers)
    store = WrappedStore(TieredStore([(CpuTier(cpu_bytes), LevelOptions()), *(lower or [])]))
    sessions = ShmSessions() if sessions is None else sessions
    server = grpc.server(ThreadPoolExecutor(max_workers=workers), options=grpc_options(cfg))
    servicer = SpyServicer(store, cfg, sessions, access=access)  # type: ignore[arg-type]
    pb_grpc.add_KVStoreServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with shm_listener(sessions, servicer):
            yield InProcessDaemon(store, sessions, f"127.0.0.1:{port}", server, servicer)
    finally:
        server.stop(None).wait()
        servicer.close()
        sessions.close()
        store.inner.close(flush=False)


class StreamDaemon(InProcessDaemon):
    streams: StreamServer


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
        with shm_listener(sessions, servicer):
            yield d
    finally:
        streams.close()
        server.stop(None).wait()
        servicer.close()
        sessions.close()
        store.inner.close(flush=False)


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


# -- blocks -----------------------------------------------------------------------------------


def block(name: str, fill: float) -> tuple[bytes, bytes]:
    key = name.encode().ljust(16, b"-")
    return key, encode_block(key, np.full(FLOATS, fill, dtype=np.float32), layout="T")


def big_block(i: int, mib: int = 4) -> tuple[bytes, bytes]:
    key = b"big-%012d" % i
    rng = np.random.default_rng(i)
    payload = rng.integers(0, 2**31, size=mib * MIB // 4 - 64, dtype=np.int32).view(np.float32)
    return key, encode_block(key, payload, layout="T")
