"""How one batch of blocks crosses to or from the daemon: shared memory or gRPC streaming.

The client decides *what* to send (batching, retries); these functions decide *how* the bytes
move for one call. With a shared-memory handle, the client writes blocks into its segment and
sends (offset, length) handles (Put), or the daemon writes blocks into the segment and answers
with handles (Get). Without one, bytes are chunked into gRPC messages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from kvstore.errors import KVStoreError
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.shm import HEADER_BYTES, Handle

ALIGN = 64
#: view(offset, length) -> a memoryview of that range of the segment
ViewFn = Callable[[int, int], memoryview]
Sink = Callable[[int, memoryview], None]


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


def get_shm(
    stub: pb_grpc.KVStoreStub, keys: list[bytes], handle: Handle, sink: Sink, timeout: float,
    view: ViewFn | None = None, keep: bool = False,
) -> list[int]:  # fmt: skip
    """Get through the segment; ``sink(i, view)`` per block found.

    ``keep=False``: the sink consumes each view at once, so every round may reuse the whole
    segment. ``keep=True``: views stay valid after the call, so rounds never overwrite earlier
    blocks; indices that no longer fit are returned for the caller to fetch elsewhere.
    """
    seg, session = handle
    view = view or (lambda off, n: seg.buf[off : off + n])
    todo = list(range(len(keys)))
    pos = HEADER_BYTES
    while todo:
        req = pb.GetRequest(keys=[keys[i] for i in todo], shm_session=session, shm_offset=pos,
                            shm_length=seg.size - pos)  # fmt: skip
        (resp,) = list(stub.Get(req, timeout=timeout))
        again: list[int] = []
        wrote = False
        for b in resp.shm:
            i = todo[b.index]
            if b.deferred:
                if b.length > seg.data_bytes:  # can never fit: fetch this one by streaming
                    get_streamed(stub, [keys[i]], lambda _j, mv, i=i: sink(i, mv), timeout)
                else:
                    again.append(i)
            elif b.found:
                sink(i, view(b.offset, b.length))
                wrote = True
                if keep:
                    pos = max(pos, align(b.offset + b.length))
        if again and not wrote:
            if pos == HEADER_BYTES:
                raise KVStoreError("daemon deferred every block of a shared-memory get")
            return again  # keep: the segment is full of blocks the caller still holds
        todo = again
    return []
