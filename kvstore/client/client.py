"""Python client of the kvstore daemon: deadlines, retries with backoff, batching, and the
same-host shared-memory path (``use_shm=None`` = try it, fall back to streaming). Without shared
memory, Gets come back on the daemon's raw TCP channel (``use_stream=None`` = when the daemon
offers one; kvstore/client/stream_client.py), else stream over gRPC.

Errors are typed at this boundary, before any retry decision (as redis-py does): gRPC's
UNAVAILABLE becomes KVStoreUnavailable and DEADLINE_EXCEEDED KVStoreTimeout (both retried, so a
call gives up within roughly ``retry.attempts x deadline_s``, never hangs); a refused request
raises InvalidRequest / ChecksumError / ResourceExhausted with the daemon's message, a missing or
wrong token AuthError, a key outside this credential's tenants PermissionDenied (neither retried;
credentials: kvstore/server/auth.py ClientAuth, kvstore/server/credentials.py); a lost
shared-memory session (ShmSessionLost) is re-attached and retried here.

One read path per transport: ``read_batches`` (a Get, over shared memory, the raw TCP channel or
gRPC streaming, whichever this client has) hands each round's blocks to a sink, as views valid only
during the call; ``get_blocks`` decodes what it read. A ``lookup(in_place=True)`` locates blocks in
the daemon's cpu arena and ``in_place_views`` reads them there with no Get.

Attaching a segment (kvstore/client/shm_link.py): AttachShm gives a ticket and the daemon's unix
socket; the segment's fd goes over that socket, and the connection stays open for as long as the
segment is used: the daemon reclaims the segment when it closes, whatever ends this process.

Zero-copy reads (``use_arena=None`` = when the daemon offers it): once attached, the client maps
the daemon's cpu-tier arena read-only from the fd the daemon passed (kvstore/client/shm.py
ArenaMap; only a client allowed to read every block gets it), and ``read_batches`` hands out
views of it for blocks held there, pinned by a lease that is released (without waiting) once the
sink returns.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import fields
from typing import TypeVar

import grpc

from kvstore.block import Block, decode_block
from kvstore.client import shm_link, transfer
from kvstore.client.retry import Retry
from kvstore.client.shm import ArenaMap, Handle, ShmPool, ShmSegment
from kvstore.client.stream_client import StreamChannel
from kvstore.errors import (
    ChecksumError,
    InvalidRequest,
    KVStoreError,
    KVStoreTimeout,
    KVStoreUnavailable,
    PermissionDenied,
    ResourceExhausted,
    ShmSessionLost,
)
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.server import stream_tls
from kvstore.server.auth import AuthError, ClientAuth
from kvstore.store.results import InPlace, LookupResult, StoreStats, TenantStats, TierStats
from tiers.base import Buffer

log = logging.getLogger(__name__)
T = TypeVar("T")
RETRY_ON = (KVStoreUnavailable, KVStoreTimeout)  # transport failures; every call is idempotent


def translate(e: grpc.RpcError) -> KVStoreError:
    """The typed error for a gRPC status (the one place that looks at status codes)."""
    code, msg = e.code(), e.details() or ""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthError(f"daemon refused the call: {msg}")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return PermissionDenied(msg)
    if code == grpc.StatusCode.UNAVAILABLE:
        return KVStoreUnavailable(f"daemon unavailable: {msg}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return KVStoreTimeout(f"daemon did not answer within the deadline: {msg}")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return ShmSessionLost(msg)
    if code == grpc.StatusCode.DATA_LOSS:
        return ChecksumError(msg)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(msg)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidRequest(msg)
    return KVStoreError(f"{code.name}: {msg}")


def _typed(fn: Callable[[], T]) -> T:
    try:
        return fn()
    except grpc.RpcError as e:
        raise translate(e) from None


class KVStoreClient:
    def __init__(
        self,
        address: str,
        deadline_s: float = 10.0,
        retry: Retry | None = None,
        use_shm: bool | None = None,
        shm_bytes: int = 128 * 1024**2,
        max_message_bytes: int = 8 * 1024**2,
        chunk_bytes: int = 4 * 1024**2,
        batch_bytes: int = 64 * 1024**2,
        batch_keys: int = 512,
        use_stream: bool | None = None,
        max_block_bytes: int = 1024**3,
        auth: ClientAuth | None = None,
        use_arena: bool | None = None,
    ) -> None:
        """``auth`` None: token and TLS files from the environment or the default token file
        (``ClientAuth.from_env``), so a daemon started on this machine is found with no flag.
        ``use_arena``: read cpu-tier blocks in place (None: when the daemon offers it; True:
        fail an attach whose arena cannot be mapped)."""
        self.address, self.deadline_s = address, deadline_s
        self.retry = retry or Retry()
        self.chunk_bytes, self.batch_bytes, self.batch_keys = chunk_bytes, batch_bytes, batch_keys
        self.auth = auth if auth is not None else ClientAuth.from_env()
        self._channel = self.auth.channel(address, [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ])  # fmt: skip
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._shm_required = use_shm is True
        self._shm = ShmPool(shm_bytes, self._attach, self._detach)
        self._shm.enabled = use_shm is not False
        self._shm.required = self._shm_required
        self._detaching: set[grpc.Future] = set()
        self._stream_required = use_stream is True
        self._stream = StreamChannel(address.rpartition(":")[0], self._open_stream, max_block_bytes,
                                     tls=stream_tls.client_context(self.auth.tls_ca, self.auth.tls_cert,
                                                                   self.auth.tls_key))  # as gRPC's
        self._stream.enabled = use_stream is not False
        self._arena_use = use_arena
        self._arena: ArenaMap | None = None
        self._leases = transfer.LeaseReleaser(self._stub)

    # -- plumbing ------------------------------------------------------------------------
    def _call(self, fn: Callable[[], T]) -> T:
        """Run one logical call: gRPC errors typed first, then transport failures retried with
        backoff; a lost shared-memory session is re-attached at once (it is not a failure)."""

        def once() -> T:
            for _ in range(3):
                try:
                    return _typed(fn)
                except ShmSessionLost:
                    continue  # the handle was abandoned: the next try attaches a fresh segment
            raise KVStoreError("shared-memory sessions keep going stale")

        return self.retry.call(once, retry_on=RETRY_ON)

    def _attach(self, seg: ShmSegment) -> str | None:
        """Hand ``seg`` to the daemon: its session id, or None when the daemon cannot take it
        (disabled, at its bound, another host: its socket is not reachable from here)."""
        assert seg.fd is not None
        want_arena = self._arena_use is not False
        req = pb.AttachShmRequest(size=seg.size, arena=want_arena, by_fd=True)
        resp = self._stub.AttachShm(req, timeout=self.deadline_s)
        if not resp.ok:
            return self._refused(resp.reason)
        try:
            link, welcome, arena_fd = shm_link.join(resp.socket, resp.ticket, seg.fd, seg.size, self.deadline_s)
        except (OSError, ValueError) as e:  # another host or mount namespace: no such socket here
            return self._refused(f"cannot hand the segment over on {resp.socket}: {e}")
        if not welcome.ok:
            link.close()
            return self._refused(welcome.reason)
        seg.link = link
        if want_arena:
            self._map_arena(arena_fd, welcome.arena_size, welcome.arena_token)
        elif arena_fd is not None:
            os.close(arena_fd)
        return welcome.session

    def _refused(self, reason: str) -> None:
        if self._shm_required:
            raise KVStoreError(f"shared memory refused by the daemon: {reason}")
        log.debug("shared memory refused by the daemon (%s): streaming", reason)
        return None

    def _map_arena(self, fd: int | None, size: int, token: bytes) -> None:
        """Map the arena the daemon passed (once per arena; a restarted daemon has a new one)."""
        if fd is not None and self._arena is not None and self._arena.token == token:
            os.close(fd)
            return
        old, self._arena = self._arena, None
        if old is not None:
            old.close()
        if fd is None:
            if self._arena_use:
                raise KVStoreError("the daemon offers no arena to read in place")
            return
        try:
            self._arena = ArenaMap(fd, size, token)
        except (OSError, ValueError) as e:  # not the arena it described: the daemon copies instead
            if self._arena_use:
                raise KVStoreError(f"cannot map the daemon's arena: {e}") from None
            log.debug("reading without the daemon's arena (%s)", e)

    def _detach(self, session: str) -> None:
        """Ask the daemon to drop a session, without waiting (it may still be busy with it)."""
        try:
            fut = self._stub.DetachShm.future(pb.DetachShmRequest(session=session), timeout=1.0)
        except ValueError:  # the channel is closed: the daemon reclaims it when we exit
            return
        self._detaching.add(fut)
        fut.add_done_callback(self._detaching.discard)

    def _open_stream(self) -> tuple[int, bytes] | None:
        try:
            resp = self._stub.OpenStream(pb.OpenStreamRequest(), timeout=self.deadline_s)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            self._stream.enabled = False  # a daemon from before the channel
            return None
        if not resp.ok and self._stream_required:
            raise KVStoreError(f"stream channel refused by the daemon: {resp.reason}")
        return (resp.port, resp.token) if resp.ok else None

    def _with_shm(self, rpc: Callable[[Handle | None], T]) -> T:
        """Run ``rpc`` on a borrowed segment. It goes back to the pool only after a call that
        completed, or that the daemon refused by its keys (PERMISSION_DENIED: it checks every key
        before it touches the session): after any other error the daemon may still be using it,
        so it is abandoned."""
        handle = _typed(self._shm.acquire)
        if handle is None:
            return rpc(None)
        try:
            out = _typed(lambda: rpc(handle))
        except PermissionDenied:
            self._shm.release(handle)
            raise
        except BaseException as e:
            self._shm.abandon(handle, stale=isinstance(e, ShmSessionLost))
            raise
        self._shm.release(handle)
        return out

    @property
    def arena_active(self) -> bool:
        """Whether reads of cpu-tier blocks are answered in place (known after the first call)."""
        return self._arena is not None and self._shm.enabled

    # -- API -----------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes], read: bool = True, deadline_s: float | None = None,
               in_place: bool = False) -> LookupResult:  # fmt: skip
        """``read=False``: a writer checking what is held (the daemon does not count it as a read).
        ``deadline_s``: this call's deadline (default: the client's). ``in_place``: also ask where
        the leading keys lie in the daemon's cpu arena (``LookupResult.in_place``, None when the
        daemon shares none): a client that maps it reads them from there with no Get
        (``in_place_views``), and the daemon counts them as read."""
        req = pb.LookupRequest(keys=list(keys), write_check=not read, in_place=in_place and read)
        timeout = self.deadline_s if deadline_s is None else deadline_s
        resp = self._call(lambda: self._stub.Lookup(req, timeout=timeout))
        where = None
        if resp.arena_token:
            where = InPlace(resp.arena_token, [(o, n) if n else None
                                               for o, n in zip(resp.arena_offsets, resp.arena_lengths, strict=True)])
        return LookupResult(resp.prefix_len, [t or None for t in resp.tiers], [t or None for t in resp.evicted_from],
                            where)

    def in_place_views(self, where: InPlace) -> list[memoryview]:
        """Read-only views of the leading blocks ``where`` (a lookup's answer) locates, in this
        client's mapping of the daemon's arena: as many as are located from the first on, none when
        this client maps no arena or another one (the daemon restarted). The bytes are not pinned:
        they may be another block's by the time they are read, so verify what is copied."""
        arena = self._arena if self._arena_use is not False else None
        if arena is None or arena.token != where.arena_token:
            return []
        views = []
        for span in where.spans:
            if span is None:
                break
            try:
                views.append(arena.view(*span))
            except ValueError:  # not in this mapping: stop there
                break
        return views

    def delete(self, keys: Sequence[bytes]) -> int:
        """Delete blocks from every tier; returns how many were present."""
        resp = self._call(lambda: self._stub.Delete(pb.DeleteRequest(keys=list(keys)), timeout=self.deadline_s))
        return int(resp.deleted)

    def stats(self) -> StoreStats:
        r = self._call(lambda: self._stub.Stats(pb.StatsRequest(), timeout=self.deadline_s))
        tiers = [TierStats(**{f.name: getattr(t, f.name) for f in fields(TierStats)}) for t in r.tiers]
        tenants = [TenantStats(**{f: getattr(t, f) for f in TenantStats._fields}) for t in r.tenants]
        return StoreStats(tiers, r.pending_blocks, r.pending_bytes, tenants, parked_blocks=r.parked_blocks,
                          parked_bytes=r.parked_bytes)

    def trace_start(self, out: str = "", max_records: int = 0) -> str:
        """Start the daemon's access trace (kvstore/ops/trace.py); returns the file ``trace_stop`` writes."""
        req = pb.TraceStartRequest(out=out, max_records=max_records)
        return self._call(lambda: self._stub.TraceStart(req, timeout=self.deadline_s)).path

    def trace_stop(self) -> tuple[str, int, int]:
        """Stop the trace and write its file: (path, records, records the ring overwrote)."""
        r = self._call(lambda: self._stub.TraceStop(pb.TraceStopRequest(), timeout=self.deadline_s))
        return r.path, int(r.records), int(r.overwritten)

    def put(self, key: bytes, block: Buffer) -> bool:
        return self.put_many([(key, block)])[0]

    def put_many(
        self, items: Sequence[tuple[bytes, Buffer]], dtype: str = "", shape: Sequence[int] = ()
    ) -> list[bool]:
        """Store encoded blocks; True per block stored, False when the daemon already held it.

        ``dtype``/``shape`` (optional) are checked by the daemon against every block.
        """
        out: list[bool] = []
        for batch in self._batches(items):
            out += self._call(lambda b=batch: self._with_shm(
                lambda h: transfer.put_batch(self._stub, b, h, dtype, shape, self.chunk_bytes, self.deadline_s)))
        return out

    def _batches(self, items: Sequence[tuple[bytes, Buffer]]) -> Iterator[list[tuple[bytes, memoryview]]]:
        limit = min(self.batch_bytes, self._shm.size) if self._shm.enabled else self.batch_bytes
        batch: list[tuple[bytes, memoryview]] = []
        size = 0
        for k, v in items:
            mv = memoryview(v).cast("B")
            n = transfer.align(mv.nbytes)
            if batch and (size + n > limit or len(batch) >= self.batch_keys):
                yield batch
                batch, size = [], 0
            batch.append((k, mv))
            size += n
        if batch:
            yield batch

    def read_batches(self, keys: Sequence[bytes], consume: transfer.BatchSink,
                     deadline_s: float | None = None) -> list[bool]:  # fmt: skip
        """Zero-copy read: ``consume([(i, view), ...])`` with every block one answer brought (all of
        them, for blocks the daemon serves in place), a round at a time; returns, per key, whether
        it was found. On the shared-memory path a view points into the daemon's cpu arena
        (read-only) or the segment the daemon wrote, so a connector copies each block once,
        straight into its KV pool pages; views must not be kept after ``consume`` returns.
        ``deadline_s``: each call's deadline (default: the client's)."""
        timeout = self.deadline_s if deadline_s is None else deadline_s
        found = [False] * len(keys)
        for start in range(0, len(keys), self.batch_keys):
            chunk = list(keys[start : start + self.batch_keys])

            def at(items: list[tuple[int, memoryview]], base: int = start) -> None:
                shifted = [(base + i, mv) for i, mv in items]
                for i, _ in shifted:
                    found[i] = True
                consume(shifted)

            self._call(lambda c=chunk, s=at: self._with_shm(lambda h: self._read_batch(c, h, s, timeout)))
        return found

    def get_blocks(self, keys: Sequence[bytes], verify: bool = True) -> list[Block | None]:
        """Decoded blocks (None for a miss), in the order of ``keys``, read with ``read_batches``;
        raises ChecksumError if a block was corrupted at rest or in transit."""
        raw: list[bytes | None] = [None] * len(keys)

        def keep(items: list[tuple[int, memoryview]]) -> None:
            for i, mv in items:
                raw[i] = bytes(mv)

        self.read_batches(keys, keep)
        return [None if b is None else decode_block(b, verify=verify) for b in raw]

    def _read_batch(self, keys: list[bytes], handle: Handle | None, consume: transfer.BatchSink,
                    timeout: float) -> None:  # fmt: skip
        if handle is None:
            sink: transfer.Sink = lambda i, mv: consume([(i, mv)])  # noqa: E731
            if not self._stream.get(keys, sink, timeout):
                transfer.get_streamed(self._stub, keys, sink, timeout)
            return
        arena = self._arena if self._arena_use is not False else None
        transfer.get_shm(self._stub, keys, handle, consume, timeout, arena=arena,
                         release=lambda lease: self._leases.release(handle[1], lease))

    def health(self, service: str = "") -> bool:
        return self.health_status(service) == "SERVING"

    def health_status(self, service: str = "") -> str:
        """gRPC health of ``service`` ("" = the daemon; ``tierkv.tier.NAME`` = one tier, see
        kvstore/server/health.py): SERVING, NOT_SERVING, UNKNOWN (no such service) or UNREACHABLE."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            r = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=self.deadline_s)
        except grpc.RpcError as e:
            return "UNKNOWN" if e.code() == grpc.StatusCode.NOT_FOUND else "UNREACHABLE"
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(r.status))

    def close(self) -> None:
        self._leases.close()
        self._stream.close()
        for seg, session in self._shm.close():
            try:
                self._stub.DetachShm(pb.DetachShmRequest(session=session), timeout=1.0)
            except grpc.RpcError:
                pass
            seg.close()
        if self._arena is not None:
            self._arena.close()
        for fut in list(self._detaching):  # abandoned segments, leases: let the daemon hear about them
            try:
                fut.result(timeout=1.0)
            except (grpc.RpcError, grpc.FutureTimeoutError, grpc.FutureCancelledError):
                pass
        self._channel.close()

    def __enter__(self) -> KVStoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
