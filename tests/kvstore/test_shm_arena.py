"""Gets answered in place from the daemon's cpu arena (tiers/cpu.py, kvstore/server/shm_sessions.py):
the bytes a client reads there cannot change under it while its lease holds them, leases end
(released, expired, bounded, dropped with the session), the mapping is read-only and proven by
its token, sealed so that nobody (root included) can write or resize it through a reopened
path, blocks held elsewhere still come through the segment."""

from __future__ import annotations

import fcntl
import mmap
import os
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore.block import encode_block
from kvstore.client.retry import Retry
from kvstore.client.shm import ArenaMap, ShmSegment
from kvstore.errors import ShmSessionLost
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.shm_sessions import ShmSessions
from kvstore.store.tier_bookkeeping import LevelOptions
from tests.fixtures_kvstore import WAIT_S, block, connect, each, fetch_one, inprocess_daemon
from tiers.cpu import ARENA_HEADER, CpuTier
from tiers.disk import DiskTier
from tiers.errors import ConfigError

BLOCK = len(block("x", 0.0)[1])


def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_bytes_read_in_place_do_not_change_while_leased() -> None:
    """Inside the client's sink, another client deletes the block, fills the arena twice over
    with other blocks and writes the same key again: the view the sink holds keeps its bytes."""
    with inprocess_daemon(cpu_bytes=4 * BLOCK + 4096) as d, \
            connect(d, use_shm=True, use_arena=True, retry=Retry(attempts=1)) as reader, \
            connect(d, use_shm=True, retry=Retry(attempts=1)) as writer:
        key, value = block("pinned", 1.0)
        reader.put(key, value)
        seen: list[tuple[bytes, bytes]] = []

        def sink(i: int, mv: memoryview) -> None:
            before = bytes(mv)
            assert writer.delete([key]) == 1
            for j in range(8):  # 8 blocks through a 4-block arena: every free run is reused
                writer.put(*block(f"other-{j}", 10.0 + j))
            writer.put(key, block("pinned", 99.0)[1])  # the same key, other bytes
            seen.append((before, bytes(mv)))

        assert reader.read_batches([key], each(sink)) == [True]
        assert reader.arena_active
        assert seen == [(value, value)], "bytes read in place changed under the reader"
        assert fetch_one(reader, key) == block("pinned", 99.0)[1]


def test_leases_are_released_after_the_read() -> None:
    with inprocess_daemon() as d, connect(d, use_shm=True, use_arena=True) as c:
        items = [block(f"rel-{i}", float(i)) for i in range(5)]
        c.put_many(items)
        got: list[bytes] = []
        c.read_batches([k for k, _ in items], each(lambda i, mv: got.append(bytes(mv))))
        assert got == [v for _, v in items]
        _wait(lambda: d.sessions.leased() == 0, "the client never released its lease")


def test_leases_expire_are_bounded_and_go_with_the_session() -> None:
    sessions = ShmSessions(lease_s=3600, max_leases=2)
    seg = ShmSegment.create(1 << 16)
    try:
        assert seg.fd is not None
        sid = sessions.attach(seg.fd, seg.size, os.getuid())
        with sessions.use(sid) as sess:
            ids = [sessions.lease(sess, [memoryview(b"x")]) for _ in range(3)]
        assert len(set(ids)) == 3 and sessions.leased() == 2  # the oldest went beyond the bound
        assert sessions.release(sid, [ids[0], ids[1], 12345]) == 1  # ids[0] was gone already
        sessions.lease_s = 1e-9
        with sessions.use(sid) as sess:
            sessions.lease(sess, [memoryview(b"y")])
        sessions.reap()
        assert sessions.leased() == 1  # the one past its time is gone; ids[2] has an hour left
        assert sessions.release(sid, [ids[2]]) == 1
        sessions.lease_s = 3600
        with sessions.use(sid) as sess:
            sessions.lease(sess, [memoryview(b"z")])
        sessions.detach(sid)
        assert sessions.leased() == 0
        with pytest.raises(ShmSessionLost):
            sess.check()
            sessions.lease(sess, [memoryview(b"w")])
    finally:
        sessions.close()
        seg.close()
    with pytest.raises(ConfigError):
        ShmSessions(lease_s=0)


def test_a_dropped_session_pins_nothing() -> None:
    """The session is dropped while its lease is held (the client was evicted or died): the
    lease goes with it, so the daemon may reuse those bytes (a reader past that point would
    fail its checksum and recompute: the loader tests cover that side)."""
    with inprocess_daemon() as d, connect(d, use_shm=True, use_arena=True) as c:
        key, value = block("drop", 2.0)
        c.put(key, value)

        def sink(i: int, mv: memoryview) -> None:
            assert d.sessions.leased() == 1
            for sid in list(d.sessions._sessions):
                d.sessions.detach(sid)
            assert d.sessions.leased() == 0

        c.read_batches([key], each(sink))


def test_the_mapping_is_read_only_and_proven_by_its_token() -> None:
    tier = CpuTier(1 << 20)
    try:
        share = tier.share()
        assert share is not None and share.size == ARENA_HEADER + (1 << 20)
        tier.put(b"k" * 16, b"\x07" * 5000)
        view = tier.get(b"k" * 16)
        assert view is not None
        offset = tier.arena_offset(view)
        assert offset is not None and offset >= ARENA_HEADER
        arena = ArenaMap(os.dup(share.fd), share.size, share.token)
        try:
            assert bytes(arena.view(offset, 5000)) == b"\x07" * 5000
            with pytest.raises(TypeError):
                arena.buf[offset] = 0  # read-only: a client can never change a stored block
            with pytest.raises(ValueError):
                arena.view(0, 16)  # the header is not a block
            with pytest.raises(ValueError):
                arena.view(share.size - 10, 11)
        finally:
            arena.close()
        with pytest.raises(ValueError, match="token"):
            ArenaMap(os.dup(share.fd), share.size, b"\0" * 16)
        with pytest.raises(ValueError, match="bytes"):
            ArenaMap(os.dup(share.fd), share.size + 4096, share.token)
        assert tier.arena_offset(memoryview(b"elsewhere")) is None
    finally:
        tier.close()
    assert tier.share() is None
    assert CpuTier(1 << 20, shared=False).share() is None


def test_blocks_from_a_lower_tier_come_through_the_segment(tmp_path: Path) -> None:
    """One Get of a block in the arena and one only on disk: the first is answered in place, the
    second copied into the segment; both arrive intact."""
    disk = DiskTier(tmp_path / "disk", 64 * BLOCK)
    with inprocess_daemon(cpu_bytes=2 * BLOCK + 4096, lower=[(disk, LevelOptions())]) as d, \
            connect(d, use_shm=True, use_arena=True, retry=Retry(attempts=1)) as c:
        items = [block(f"mix-{i}", float(i)) for i in range(6)]
        c.put_many(items)
        _wait(lambda: d.store.stats().pending_blocks == 0, "spills never finished")
        lower_key, lower_value = items[0]  # the oldest: spilled to disk
        assert d.store.lookup([lower_key]).tiers == ["disk"]
        top = d.store.levels[0].tier  # a block the cpu tier holds in its arena (not a heap copy)
        top_key, top_value = next((k, v) for k, v in items if k in top._blocks and top._blocks[k].offset >= 0)
        seg, sid = c._shm._free[0]
        resp = c._stub.GetShm(pb.GetRequest(keys=[top_key, lower_key], shm_session=sid, shm_offset=4096,
                                            shm_length=seg.size - 4096, arena=True), timeout=WAIT_S)
        assert [(b.found, b.arena) for b in resp.shm] == [(True, True), (True, False)] and resp.lease
        c._stub.ReleaseLease(pb.ReleaseLeaseRequest(session=sid, leases=[resp.lease]), timeout=WAIT_S)
        got: dict[int, bytes] = {}
        c.read_batches([top_key, lower_key], each(lambda i, mv: got.__setitem__(i, bytes(mv))))
        assert got == {0: top_value, 1: lower_value}


def test_the_arena_cannot_be_written_or_resized_by_anyone_but_the_tier() -> None:
    """Clients get a read-only descriptor; the memfd's mode is 0 (no other user reopens it through
    /proc/<daemon>/fd); and whoever reopens it anyway (root ignores modes) can neither map it
    writable, write it, nor resize it (a shrink would SIGBUS the daemon): it is sealed. Every page
    is reserved at start. The tier itself still writes."""
    tier = CpuTier(1 << 20)
    try:
        share = tier.share()
        assert share is not None
        assert fcntl.fcntl(share.fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
        st = os.fstat(share.fd)
        assert st.st_mode & 0o777 == 0 and st.st_blocks * 512 >= share.size
        try:
            rw = os.open(f"/proc/self/fd/{share.fd}", os.O_RDWR)
        except PermissionError:
            assert os.getuid() != 0  # mode 0: only root gets this far
        else:
            try:
                with pytest.raises(PermissionError):
                    mmap.mmap(rw, share.size)  # a writable shared mapping
                with pytest.raises(PermissionError):
                    os.pwrite(rw, b"x", ARENA_HEADER)
                with pytest.raises(PermissionError):
                    os.ftruncate(rw, 0)
                with pytest.raises(PermissionError):
                    os.posix_fallocate(rw, 0, share.size + (1 << 20))
            finally:
                os.close(rw)
        tier.put(b"k" * 16, b"\x05" * 5000)
        assert bytes(tier.get(b"k" * 16)) == b"\x05" * 5000  # type: ignore[arg-type]
    finally:
        tier.close()


def test_the_daemon_can_keep_its_arena_private() -> None:
    """shm_arena=False (--no-shm-arena): no arena offered, every Get is copied."""
    from dataclasses import replace

    with inprocess_daemon() as d:
        from kvstore.server.servicer import KVStoreServicer

        private = KVStoreServicer(d.store, replace(d.servicer.cfg, shm_arena=False), d.sessions)  # type: ignore[arg-type]
        assert private.arena is None and private.arena_share is None
        assert d.servicer.arena is not None


def test_blocks_kept_after_the_read_are_copies() -> None:
    """get_blocks keeps its blocks after the call: they are copies of what was read in place, and
    no lease stays pinned for them."""
    with inprocess_daemon() as d, connect(d, use_shm=True, use_arena=True) as c:
        key = b"kept-block-00001"
        payload = np.full(4096, 4.0, dtype=np.float32)
        c.put(key, encode_block(key, payload))
        (kept,) = c.get_blocks([key])
        assert c.arena_active and kept is not None and np.array_equal(kept.array(), payload)
        _wait(lambda: d.sessions.leased() == 0, "a lease stayed pinned for blocks kept after the read")
        assert isinstance(kept.payload.obj, bytes)  # over the client's own copy, not the arena
        del kept


def test_encode_block_round_trip_through_the_arena_loader_path() -> None:
    """A real block read in place decodes and verifies (what the connector's loader relies on)."""
    from kvstore.block import decode_block

    with inprocess_daemon() as d, connect(d, use_shm=True, use_arena=True) as c:
        key = b"decode-me-please"
        blk = encode_block(key, np.arange(4096, dtype=np.float32))
        c.put(key, blk)
        out: list[bytes] = []
        c.read_batches([key], each(lambda i, mv: out.append(bytes(decode_block(mv).payload))))
        assert out == [np.arange(4096, dtype=np.float32).tobytes()]


def test_the_arena_file_goes_with_the_tier() -> None:
    """Its pages live as long as its fd: closed by close() (once), or when the tier is collected."""
    import gc
    import os

    tier = CpuTier(1 << 20)
    share = tier.share()
    assert share is not None and os.fstat(share.fd).st_size == share.size
    tier.close()
    tier.close()
    with pytest.raises(OSError):
        os.fstat(share.fd)
    other = CpuTier(1 << 20)
    fd = other.share().fd  # type: ignore[union-attr]
    del other
    gc.collect()
    with pytest.raises(OSError):
        os.fstat(fd)
