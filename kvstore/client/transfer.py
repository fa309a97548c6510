"""How one batch of blocks crosses to or from the daemon: shared memory or gRPC streaming.

The client decides *what* to send (batching, retries); these functions decide *how* the bytes
move for one call. With a shared-memory handle, the client writes blocks into its segment and
sends (offset, length) handles (Put), or the daemon writes blocks into the segment and answers
with handles (Get). Without one, bytes are chunked into gRPC messages. A client that mapped the
daemon's cpu arena (``ArenaMap``) lets the daemon answer a Get in place: handles into the arena,
pinned by a lease that ``release`` ends once the round's blocks were consumed.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator, Sequence

import grpc

from kvstore.client.shm import HEADER_BYTES, ArenaMap, Handle
from kvstore.errors import KVStoreError
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
ALIGN = 64
Sink = Callable[[int, memoryview], None]
#: consume([(i, view), ...]): the blocks of one round at once, views valid only during the call
BatchSink = Callable[[list[tuple[int, memoryview]]], None]


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def put_batch(
    stub: pb_grpc.KVStoreStub, batch: Sequence[tuple[bytes, memoryview]], handle: Handle | None,
    dtype: str, shape: Sequence[int], chunk_bytes: int, timeout: float,
) -> list[bool]:  # fmt: skip
    """One two-phase Put; True per block stored, False when the daemon already held it."""
    specs = [pb.BlockSpec(key=k, size=v.nbytes, dtype=dtype, shape=list(shape)) for k, v in batch]
    refs: list[pb.ShmRef] = []
    streamed = list(range(len(batch)))
    session = ""
    if handle is not None:
        seg, session = handle
        pos, streamed = HEADER_BYTES, []
        for i, (_, v) in enumerate(batch):
            if pos + v.nbytes <= seg.size:
                seg.buf[pos : pos + v.nbytes] = v
                refs.append(pb.ShmRef(index=i, offset=pos, length=v.nbytes))
                pos += align(v.nbytes)
            else:
                streamed.append(i)

    def messages() -> Iterator[pb.PutRequest]:
        yield pb.PutRequest(begin=pb.PutBegin(blocks=specs, shm_session=session if refs else ""))
        for i in streamed:
            v = batch[i][1]
            for off in range(0, v.nbytes, chunk_bytes):
                yield pb.PutRequest(chunk=pb.PutChunk(index=i, offset=off, data=bytes(v[off : off + chunk_bytes])))
        yield pb.PutRequest(commit=pb.PutCommit(shm=refs))

    resp = stub.Put(messages(), timeout=timeout)
    return [s == pb.STORED for s in resp.status]


def get_streamed(stub: pb_grpc.KVStoreStub, keys: list[bytes], sink: Sink, timeout: float) -> None:
    parts: dict[int, bytearray] = {}
    for r in stub.Get(pb.GetRequest(keys=keys), timeout=timeout):
        if r.found:
            buf = parts.setdefault(r.index, bytearray(r.total))
            buf[r.offset : r.offset + len(r.data)] = r.data
    for i in sorted(parts):
        sink(i, memoryview(parts[i]))


def _ask(stub: pb_grpc.KVStoreStub, req: pb.GetRequest, timeout: float) -> pb.GetResponse:
    """One shared-memory Get: the unary call, or the streamed one on a daemon without it."""
    try:
        return stub.GetShm(req, timeout=timeout)
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise
    (resp,) = list(stub.Get(req, timeout=timeout))
    return resp


def get_shm(
    stub: pb_grpc.KVStoreStub, keys: list[bytes], handle: Handle, consume: BatchSink, timeout: float,
    arena: ArenaMap | None = None, release: Callable[[int], None] | None = None,
) -> None:  # fmt: skip
    """Get through the segment; ``consume`` gets the blocks found, one round at a time. Each
    round's views are consumed at once, so every round may reuse the whole segment. ``arena``
    (with ``release``: the daemon's bytes are pinned only until then): blocks the daemon holds
    there come back as views of it, and each round's lease is released right after its blocks
    were consumed.
    """
    if arena is not None and release is None:
        raise ValueError("in-place arena reads need a release callback")
    seg, session = handle
    todo = list(range(len(keys)))
    pos = HEADER_BYTES
    while todo:
        req = pb.GetRequest(keys=[keys[i] for i in todo], shm_session=session, shm_offset=pos,
                            shm_length=seg.size - pos, arena=arena is not None)  # fmt: skip
        resp = _ask(stub, req, timeout)
        again: list[int] = []
        found: list[tuple[int, memoryview]] = []
        wrote = False
        try:
            for b in resp.shm:
                i = todo[b.index]
                if b.deferred:
                    if b.length > seg.data_bytes:  # can never fit: fetch this one by streaming
                        get_streamed(stub, [keys[i]], lambda _j, mv, i=i: consume([(i, mv)]), timeout)
                    else:
                        again.append(i)
                elif b.found and b.arena:
                    if arena is None:
                        raise KVStoreError("daemon answered in its arena, which this call did not map")
                    found.append((i, arena.view(b.offset, b.length)))
                elif b.found:
                    found.append((i, seg.buf[b.offset : b.offset + b.length]))
            wrote = bool(found)
            if found:
                consume(found)
        finally:
            found.clear()  # drop the views before the lease ends
            if resp.lease and release is not None:
                release(resp.lease)
        if again and not wrote:
            raise KVStoreError("daemon deferred every block of a shared-memory get")
        todo = again


class LeaseReleaser:
    """Ends the daemon's leases (its pins on blocks a client read in place) from a background
    thread, several per call, so a read returns as soon as its blocks were copied. Best effort:
    the daemon expires a lease it never hears about (kvstore/server/shm_sessions.py)."""

    def __init__(self, stub: pb_grpc.KVStoreStub, timeout_s: float = 5.0) -> None:
        self._stub, self._timeout = stub, timeout_s
        self._queue: queue.SimpleQueue[tuple[str, int] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False

    def release(self, session: str, lease: int) -> None:
        with self._lock:
            if self._closed:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="tierkv-lease-release", daemon=True)
                self._thread.start()
        self._queue.put((session, lease))

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            by_session: dict[str, list[int]] = {item[0]: [item[1]]}
            while True:  # whatever else is already waiting goes in the same calls
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._send(by_session)
                    return
                by_session.setdefault(more[0], []).append(more[1])
            self._send(by_session)

    def _send(self, by_session: dict[str, list[int]]) -> None:
        for session, leases in by_session.items():
            try:
                self._stub.ReleaseLease(pb.ReleaseLeaseRequest(session=session, leases=leases), timeout=self._timeout)
            except (grpc.RpcError, ValueError) as e:  # daemon gone or channel closed: it expires them
                log.debug("lease release failed: %s", e)

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued, then stop."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout_s)
