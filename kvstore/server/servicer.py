"""gRPC servicer: translates protobuf to plain TieredStore calls and errors to gRPC statuses.

It owns no storage logic. What it does own is the daemon's edge: every size limit and every
validation happens here, before the store sees a byte. A Put is two-phase: the begin message
declares every block (key, size, optional dtype/shape), chunks or shared-memory handles bring
the bytes, and only a commit stores anything — after *every* block in the batch has been
checked (complete, decodable, checksum, key, dtype/shape). A bad block fails the whole call
with a clear status and nothing stored. A Put holds one of ``max_put_streams`` slots and must be
read to its commit within ``put_stream_timeout_s`` (kvstore/server/put_streams.py), so Put streams
that never commit cannot hold every worker.

A shared-memory Get from a client that mapped the cpu tier's arena (its fd came with the
session, kvstore/server/shm_listener.py) is answered in place: for a block in that arena the
answer is its offset there, and the view that pins it goes into a lease of the session until the
client releases it (kvstore/server/shm_sessions.py). The daemon copies nothing; the client copies
each block out and verifies its copy. Blocks from anywhere else (lower tiers, the spill queue,
heap copies) are copied into the segment as before.

Every call that names keys checks each of them against the caller's credential first
(kvstore/server/credentials.py ``Caller.check``): one refused key fails the whole call with
PERMISSION_DENIED and nothing read, stored or deleted; a shared-memory Get is such a call too.
Stats shows a tenant's credential its own tenants' rows only; traces are an admin's. Only a caller
that may read every key (``Caller.sees_all``) is given the cpu arena or answered in place; a
session serves only calls made with the credential that attached it (``Caller.credential``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict

import grpc

from kvstore.block import MAX_KEY_LEN, decode_block
from kvstore.client.transfer import align
from kvstore.config.store_config import StoreConfig
from kvstore.errors import (
    BlockFormatError,
    ChecksumError,
    PermissionDenied,
    ResourceExhausted,
    ShmSessionLost,
    StoreClosed,
)
from kvstore.ops.trace import TraceControl, TraceError
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.server.credentials import Access, Caller
from kvstore.server.put_streams import PutStreams
from kvstore.server.shm_sessions import Session, ShmSessions
from kvstore.server.stream_server import MAX_KEYS, StreamServer
from kvstore.store.tiered_store import TieredStore
from tiers.base import Arena
from tiers.errors import BlockTooLarge
from tiers.memfd import ArenaShare

log = logging.getLogger(__name__)


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def _check_keys(keys: list[bytes], limit: int = MAX_KEYS) -> None:
    if len(keys) > limit:
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{len(keys)} keys in one call (max {limit})")
    for i, k in enumerate(keys):
        if not 0 < len(k) <= MAX_KEY_LEN:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"key {i}: length {len(k)} outside 1..{MAX_KEY_LEN}")


class KVStoreServicer(pb_grpc.KVStoreServicer):
    def __init__(self, store: TieredStore, config: StoreConfig, sessions: ShmSessions,
                 streams: StreamServer | None = None, access: Access | None = None) -> None:  # fmt: skip
        self.store, self.cfg, self.sessions, self.streams = store, config, sessions, streams
        self.access = access if access is not None else Access(None)  # None: no auth, every caller admin
        arena = store.arena() if config.shm and config.shm_arena else None
        share = arena.share() if arena is not None else None
        self.arena: Arena | None = arena if share is not None else None  # Gets answered in place
        self.arena_share: ArenaShare | None = share  # what the shm listener hands a caller that sees all
        self.trace = TraceControl(store, config.traces_path, config.trace_max_records)
        self.put_streams = PutStreams(config.put_streams, config.put_stream_timeout_s)
        self.on_trace_written: Callable[[str], object] | None = None  # told each trace file written

    def _caller(self, context: grpc.ServicerContext) -> Caller:
        """The credential of this call (the auth interceptor already refused unknown tokens)."""
        caller = self.access.caller(context.invocation_metadata())
        if caller is None:
            raise _Abort(grpc.StatusCode.UNAUTHENTICATED, "unknown bearer token")
        return caller

    def _run(self, context: grpc.ServicerContext, fn):  # type: ignore[no-untyped-def]
        try:
            return fn()
        except _Abort as e:
            context.abort(e.code, e.message)
        except PermissionDenied as e:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        except ShmSessionLost as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except StoreClosed as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        except TraceError as e:  # the client raises it as InvalidRequest, with this message
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    # -- unary calls ---------------------------------------------------------------------
    def Lookup(self, request: pb.LookupRequest, context: grpc.ServicerContext) -> pb.LookupResponse:
        def go() -> pb.LookupResponse:
            keys = list(request.keys)
            caller = self._checked(keys, context)
            res = self.store.lookup(keys, read=not request.write_check)
            resp = pb.LookupResponse(prefix_len=res.prefix_len, tiers=[t or "" for t in res.tiers],
                                     evicted_from=[t or "" for t in res.evicted_from])
            share = self.arena.share() if self.arena is not None and request.in_place and caller.sees_all else None
            if share is not None and not request.write_check:
                spans = self.store.read_in_place(keys[: res.prefix_len], self.arena.locate)  # type: ignore[union-attr]
                resp.arena_offsets.extend(s[0] if s else 0 for s in spans)
                resp.arena_lengths.extend(s[1] if s else 0 for s in spans)
                resp.arena_token = share.token
            return resp

        return self._run(context, go)

    def Delete(self, request: pb.DeleteRequest, context: grpc.ServicerContext) -> pb.DeleteResponse:
        def go() -> pb.DeleteResponse:
            keys = list(request.keys)
            _check_keys(keys, self.cfg.max_keys_per_call)
            self._caller(context).check(keys, write=True)
            return pb.DeleteResponse(deleted=sum(1 for k in keys if self.store.delete(k)))

        return self._run(context, go)

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        return self._run(context, lambda: self._stats(self._caller(context)))

    def _stats(self, caller: Caller) -> pb.StatsResponse:
        """Everything for an admin; a tenant's credential gets its own tenants' rows and, of each
        tier, only what it is (name, capacity, attached): the tier's totals count other tenants."""
        show = self.access.display
        if caller.admin:
            st = self.store.stats()
            return pb.StatsResponse(
                tiers=[pb.TierStats(**asdict(t)) for t in st.tiers],
                pending_blocks=st.pending_blocks,
                pending_bytes=st.pending_bytes,
                parked_blocks=st.parked_blocks,
                parked_bytes=st.parked_bytes,
                tenants=[pb.TenantStats(**{**t._asdict(), "tenant": show(t.tenant)}) for t in st.tenants],
            )
        st = self.store.stats(only=caller.names)
        return pb.StatsResponse(
            tiers=[pb.TierStats(name=t.name, capacity_bytes=t.capacity_bytes, available=t.available) for t in st.tiers],
            tenants=[pb.TenantStats(**{**t._asdict(), "tenant": show(t.tenant)}) for t in st.tenants],
        )

    def AttachShm(self, request: pb.AttachShmRequest, context: grpc.ServicerContext) -> pb.AttachShmResponse:
        """A ticket the client spends on the daemon's unix socket, handing over its segment's fd
        (kvstore/server/shm_listener.py). The session it opens belongs to this call's credential;
        the arena goes with it only to a caller that may read every key."""
        if not self.cfg.shm:
            return pb.AttachShmResponse(ok=False, reason="shared memory disabled on this daemon")
        if not self.sessions.socket_path:
            return pb.AttachShmResponse(ok=False, reason="this daemon has no shared-memory socket")
        if not request.by_fd:  # a client from before would take ok for a session it never got
            return pb.AttachShmResponse(ok=False, reason="this daemon takes segments as fds over its unix socket "
                                        "only: update the client (it streams meanwhile)")
        caller: Caller = self._run(context, lambda: self._caller(context))
        arena = request.arena and self.arena is not None and caller.sees_all
        try:
            ticket = self.sessions.ticket(request.size, caller.credential, arena)
        except (ValueError, ResourceExhausted) as e:  # a size no segment has, or the bound is reached
            return pb.AttachShmResponse(ok=False, reason=str(e))
        return pb.AttachShmResponse(ok=True, ticket=ticket, socket=self.sessions.socket_path)

    def DetachShm(self, request: pb.DetachShmRequest, context: grpc.ServicerContext) -> pb.DetachShmResponse:
        caller: Caller = self._run(context, lambda: self._caller(context))
        self.sessions.detach(request.session, caller.credential)
        return pb.DetachShmResponse()

    def ReleaseLease(self, request: pb.ReleaseLeaseRequest, context: grpc.ServicerContext) -> pb.ReleaseLeaseResponse:
        caller: Caller = self._run(context, lambda: self._caller(context))
        self.sessions.release(request.session, request.leases, caller.credential)
        return pb.ReleaseLeaseResponse()

    def OpenStream(self, request: pb.OpenStreamRequest, context: grpc.ServicerContext) -> pb.OpenStreamResponse:
        if self.streams is None:
            return pb.OpenStreamResponse(ok=False, reason="no stream channel on this daemon")
        self._run(context, lambda: self._caller(context))  # an unknown token gets no grant
        token = self.streams.issue(self.access.binding(context.invocation_metadata()))
        if token is None:
            return pb.OpenStreamResponse(ok=False, reason=f"stream channel at its limit of {self.streams.max_conns}")
        return pb.OpenStreamResponse(ok=True, port=self.streams.port, token=token)

    def TraceStart(self, request: pb.TraceStartRequest, context: grpc.ServicerContext) -> pb.TraceStartResponse:
        def go() -> pb.TraceStartResponse:
            self._caller(context).check_admin("TraceStart")  # a trace records every tenant's keys
            return pb.TraceStartResponse(path=self.trace.start(request.out, request.max_records))

        return self._run(context, go)

    def TraceStop(self, request: pb.TraceStopRequest, context: grpc.ServicerContext) -> pb.TraceStopResponse:
        def go() -> pb.TraceStopResponse:
            self._caller(context).check_admin("TraceStop")
            path, records, overwritten = self.trace.stop()
            if self.on_trace_written is not None:
                self.on_trace_written(path)
            return pb.TraceStopResponse(path=path, records=records, overwritten=overwritten)

        return self._run(context, go)

    # -- Put (client-streamed, two-phase) ------------------------------------------------
    def Put(self, request_iterator: Iterator[pb.PutRequest], context: grpc.ServicerContext) -> pb.PutResponse:
        stream = self.put_streams.admit(context)  # a slot, and a deadline (kvstore/server/put_streams.py)
        if stream is None:
            # UNAVAILABLE: transient, so clients retry it with backoff (a refused block would not be)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.put_streams.max_streams} Put streams are open on "
                          "this daemon (max_put_streams): try again later")
        try:
            return self._run(context, lambda: self._put(request_iterator, self._caller(context), stream.read_done))
        finally:
            self.put_streams.release(stream)

    def close(self) -> None:
        self.put_streams.close()

    def _put(self, requests: Iterator[pb.PutRequest], caller: Caller,
             read_done: Callable[[], bool] = lambda: True) -> pb.PutResponse:  # fmt: skip
        """``read_done``: called once the stream was read; False when its deadline came first."""
        bad = grpc.StatusCode.INVALID_ARGUMENT
        first = next(requests, None)
        if first is None or first.WhichOneof("kind") != "begin":
            raise _Abort(bad, "a Put stream must start with a begin message")
        specs = list(first.begin.blocks)
        keys = [s.key for s in specs]
        _check_keys(keys, self.cfg.max_keys_per_call)
        caller.check(keys, write=True)  # before a byte is read: nothing stored
        total = 0
        for i, s in enumerate(specs):
            if s.size == 0:  # no block is empty: without this check a commit would validate None
                raise _Abort(bad, f"block {i}: declared size 0")
            if s.size > min(self.cfg.max_block_bytes, self.store.max_block_bytes):
                raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"block {i}: {s.size} bytes is over the block limit")
            total += s.size
        if total > self.cfg.max_batch_bytes:
            raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"batch of {total} bytes is over the limit")
        held = [t is not None for t in self.store.lookup(keys, read=False).tiers]
        bufs: list[bytearray | bytes | None] = [None] * len(specs)
        got = [0] * len(specs)
        commit = None
        for msg in requests:
            kind = msg.WhichOneof("kind")
            if kind == "chunk":
                c = msg.chunk
                if c.index >= len(specs) or c.offset != got[c.index] or c.offset + len(c.data) > specs[c.index].size:
                    raise _Abort(bad, f"chunk out of order or out of bounds (block {c.index}, offset {c.offset})")
                got[c.index] += len(c.data)
                if held[c.index]:
                    continue
                if bufs[c.index] is None:
                    bufs[c.index] = bytearray(specs[c.index].size)
                bufs[c.index][c.offset : c.offset + len(c.data)] = c.data  # type: ignore[index]
            elif kind == "commit":
                commit = msg.commit
                break
            else:
                raise _Abort(bad, f"unexpected {kind} message inside a Put")
        if not read_done():
            raise _Abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"Put stream not committed within "
                         f"{self.cfg.put_stream_timeout_s} s (put_stream_timeout_s): nothing stored")
        if commit is None:
            raise _Abort(grpc.StatusCode.ABORTED, "Put stream ended without commit: nothing stored")
        if commit.shm:
            self._copy_out(first.begin.shm_session, commit.shm, specs, held, bufs, got, caller)
        for i, s in enumerate(specs):
            if got[i] != s.size:
                raise _Abort(bad, f"block {i}: received {got[i]} of {s.size} bytes")
            if not held[i]:
                self._validate(i, s, bufs[i])  # type: ignore[arg-type]
        status: list[int] = []
        for i, s in enumerate(specs):
            try:
                stored = not held[i] and self.store.put(s.key, bufs[i])  # type: ignore[arg-type]
            except BlockTooLarge as e:
                raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"block {i}: {e}") from None
            status.append(pb.STORED if stored else pb.ALREADY_PRESENT)
        return pb.PutResponse(status=status)

    def _copy_out(self, sid: str, refs: list[pb.ShmRef], specs: list[pb.BlockSpec], held: list[bool],
                  bufs: list[bytearray | bytes | None], got: list[int], caller: Caller) -> None:  # fmt: skip
        """Copy each block out of the client's segment first: the client can still write there,
        so what is validated and stored must be our own copy, never the shared bytes."""
        with self.sessions.use(sid, caller.credential) as sess:
            seg = sess.seg
            for ref in refs:
                if ref.index >= len(specs) or ref.length != specs[ref.index].size:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"shm handle for block {ref.index} does not match its declared size")
                try:
                    seg.check_range(ref.offset, ref.length)
                except ValueError as e:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
                if not held[ref.index]:
                    bufs[ref.index] = bytes(seg.buf[ref.offset : ref.offset + ref.length])
                got[ref.index] = ref.length

    @staticmethod
    def _validate(i: int, spec: pb.BlockSpec, buf: bytearray | memoryview) -> None:
        try:
            blk = decode_block(buf)
        except ChecksumError as e:
            raise _Abort(grpc.StatusCode.DATA_LOSS, f"block {i}: {e}") from None
        except BlockFormatError as e:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"block {i}: {e}") from None
        if blk.key != spec.key:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"block {i}: key inside the block differs from its key")
        if spec.dtype and blk.dtype.str != spec.dtype:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"block {i}: dtype {blk.dtype.str}, expected {spec.dtype}")
        if spec.shape and tuple(spec.shape) != blk.shape:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"block {i}: shape {blk.shape}, expected {tuple(spec.shape)}")

    # -- Get (server-streamed) -----------------------------------------------------------
    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext) -> Iterator[pb.GetResponse]:
        keys = list(request.keys)
        caller: Caller = self._run(context, lambda: self._checked(keys, context))
        if request.shm_session:
            yield self._run(context, lambda: self._get_shm(request, keys, caller, context))
            return
        step = self.cfg.chunk_bytes
        for i, k in enumerate(keys):
            try:
                data = self.store.get(k)
            except StoreClosed as e:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            if data is None:
                yield pb.GetResponse(index=i, found=False)
                continue
            for off in range(0, max(len(data), 1), step):
                yield pb.GetResponse(index=i, found=True, total=len(data), offset=off, data=data[off : off + step])

    def GetShm(self, request: pb.GetRequest, context: grpc.ServicerContext) -> pb.GetResponse:
        def go() -> pb.GetResponse:
            keys = list(request.keys)
            caller = self._checked(keys, context)
            if not request.shm_session:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "GetShm needs a shared-memory session")
            return self._get_shm(request, keys, caller, context)

        return self._run(context, go)

    def _checked(self, keys: list[bytes], context: grpc.ServicerContext) -> Caller:
        """The caller of a read of ``keys``, once the keys are well-formed and it may read each."""
        _check_keys(keys, self.cfg.max_keys_per_call)
        caller = self._caller(context)
        caller.check(keys)
        return caller

    def _get_shm(self, request: pb.GetRequest, keys: list[bytes], caller: Caller,
                 context: grpc.ServicerContext) -> pb.GetResponse:  # fmt: skip
        """``keys`` are ones ``caller`` may read (``_checked``), into the session it attached."""
        with self.sessions.use(request.shm_session, caller.credential) as sess:
            try:
                sess.seg.check_range(request.shm_offset, request.shm_length)
            except ValueError as e:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            pins: list[memoryview] = []
            # in place only for a session given the arena, and a caller who still sees all (a reload
            # may have narrowed its credential since)
            arena = self.arena if request.arena and sess.arena and caller.sees_all else None
            blocks = self._write_blocks(sess, keys, request.shm_offset, request.shm_offset + request.shm_length,
                                        context, arena, pins)
            if pins and not context.is_active():  # the client gave up: nobody reads these in place
                raise _Abort(grpc.StatusCode.CANCELLED, "the client gave up on this call")
            return pb.GetResponse(shm=blocks, lease=self.sessions.lease(sess, pins) if pins else 0)

    def _write_blocks(self, sess: Session, keys: list[bytes], pos: int, end: int, context: grpc.ServicerContext,
                      arena: Arena | None, pins: list[memoryview]) -> list[pb.ShmBlock]:  # fmt: skip
        """Copy each block into [pos, end) of the segment; a block that does not fit is deferred.
        With ``arena``, a block in it is answered in place instead, its view kept in ``pins``.

        Before each write: a client that gave up (deadline, cancel) no longer reads this segment
        and a dropped session must not be written to, so the call stops there."""
        seg = sess.seg
        out: list[pb.ShmBlock] = []
        for i, k in enumerate(keys):

            def sink(mv: memoryview, i: int = i) -> pb.ShmBlock:
                nonlocal pos
                n = mv.nbytes
                at = arena.arena_offset(mv) if arena is not None else None
                if at is not None:  # the view pins these bytes while the lease keeps it
                    pins.append(mv)
                    return pb.ShmBlock(index=i, found=True, offset=at, length=n, arena=True)
                if pos + n > end:
                    return pb.ShmBlock(index=i, found=True, deferred=True, length=n)
                if not context.is_active():
                    raise _Abort(grpc.StatusCode.CANCELLED, "the client gave up on this call")
                sess.check()
                seg.buf[pos : pos + n] = mv
                blk = pb.ShmBlock(index=i, found=True, offset=pos, length=n)
                pos += align(n)
                return blk

            res = self.store.read(k, sink)
            out.append(res if res is not None else pb.ShmBlock(index=i, found=False))
        return out
