"""Reads copy outside the store lock, and what they read is pinned while they read it; so do
writes into the top tier, and a lookup's questions to a shared tier.

Why: the daemon serves many clients from threads; with every copy under one lock, clients were
served one at a time. A reader now holds only its source (the cpu tier's lease on an arena run)
while it copies, so writers, evictions and deletes go on meanwhile and never reuse those bytes.
A put's (or a promotion's) copy into the top tier runs without the lock too: a get of another key
waited 0.45 s behind a slowed put in one review. Those tests hold a real tier's call on an Event.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from kvstore.block import decode_block, encode_block
from kvstore.store.tier_bookkeeping import LevelOptions
from kvstore.store.tiered_store import TieredStore
from tiers.base import Buffer
from tiers.cpu import CpuTier
from tiers.disk import DiskTier

pytestmark = pytest.mark.timeout(300)

BLOCK = 64 * 1024
WAIT_S = 60.0  # generous: the box is shared; a blocked writer never finishes at all


def _k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def _v(i: int) -> bytes:
    payload = np.frombuffer((i.to_bytes(4, "little") * (BLOCK // 4))[: BLOCK - 64], dtype=np.uint8)
    return encode_block(_k(i), payload)


def _store(tmp: Path, cpu_blocks: int = 4, disk_blocks: int = 64) -> TieredStore:
    return TieredStore([(CpuTier(cpu_blocks * BLOCK), LevelOptions()),
                        (DiskTier(tmp / "disk", disk_blocks * BLOCK), LevelOptions())])  # fmt: skip


def test_a_block_being_read_is_pinned_while_writers_evict_and_delete_it(tmp_path: Path) -> None:
    """Inside a read, another thread deletes the block and fills the top tier twice over: it
    must not wait for the reader, and the bytes the reader holds must not change."""
    with _store(tmp_path) as s:
        s.put(_k(0), _v(0))
        writer_done = threading.Event()
        seen: list[bytes] = []

        def writer() -> None:
            s.delete(_k(0))
            for i in range(1, 9):  # 8 blocks through a 4-block arena: every free run is reused
                s.put(_k(i), _v(i))
            s.put(_k(0), _v(100))  # the same key, other bytes
            writer_done.set()

        def sink(mv: memoryview) -> None:
            seen.append(bytes(mv))
            t = threading.Thread(target=writer)
            t.start()
            assert writer_done.wait(WAIT_S), "a writer waited for a reader: reads hold the store lock"
            t.join()
            seen.append(bytes(mv))  # the same view, after the writer's churn

        s.read(_k(0), sink)
        assert seen == [_v(0), _v(0)]
        s.flush()
        assert s.get(_k(0)) == _v(100) and all(s.get(_k(i)) == _v(i) for i in range(1, 9))


def test_concurrent_readers_writers_and_evictions_get_correct_bytes(tmp_path: Path) -> None:
    """Many threads on a small top tier (constant eviction to disk): every read is the exact block."""
    keys = 48
    errors: list[str] = []
    with _store(tmp_path, cpu_blocks=6, disk_blocks=4 * keys) as s:
        for i in range(keys // 2):
            s.put(_k(i), _v(i))

        def reader(seed: int) -> None:
            rng = np.random.default_rng(seed)
            for _ in range(150):
                i = int(rng.integers(keys))

                def check(mv: memoryview, i: int = i) -> None:
                    if bytes(mv) != _v(i) or decode_block(mv).key != _k(i):
                        errors.append(f"reader {seed}: wrong bytes for block {i}")

                s.read(_k(i), check)

        def writer(seed: int) -> None:
            rng = np.random.default_rng(seed)
            for _ in range(100):
                i = int(rng.integers(keys))
                if rng.integers(4) == 0:
                    s.delete(_k(i))
                else:
                    s.put(_k(i), _v(i))

        threads = [threading.Thread(target=reader, args=(n,)) for n in range(6)]
        threads += [threading.Thread(target=writer, args=(100 + n,)) for n in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S * 4)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        s.flush()
        cpu, disk = s.stats().tiers
        assert cpu.evictions > 0 and cpu.used_bytes <= cpu.capacity_bytes and disk.used_bytes <= disk.capacity_bytes
        for i in range(keys):
            got = s.get(_k(i))
            assert got is None or got == _v(i)


# -- writes into the top tier, and a lookup's questions to a shared tier, without the lock -----


class Hold:
    """Holds the calls it is asked about until released; says when one entered."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self) -> None:
        self.entered.set()
        assert self.release.wait(WAIT_S), "never released"


class SlowCpu(CpuTier):
    """The cpu tier, with its put of ``slow_key`` (once set) held inside the copy."""

    def __init__(self, capacity: int, hold: Hold) -> None:
        super().__init__(capacity, shared=False)
        self.slow_key: bytes | None = None
        self.hold = hold

    def put(self, key: bytes, value: Buffer) -> None:
        if key == self.slow_key:
            self.hold()
        super().put(key, value)


class HeldContains(DiskTier):
    """The disk tier (as a shared level), with its contains_many held while ``hold`` is set."""

    hold: Hold | None = None

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        if self.hold is not None:
            self.hold()
        return super().contains_many(keys)


def _in_thread(fn) -> tuple[threading.Thread, threading.Event, list]:  # type: ignore[no-untyped-def]
    done, out = threading.Event(), []

    def run() -> None:
        out.append(fn())
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, done, out


def test_a_get_completes_while_another_keys_put_is_held_in_its_copy() -> None:
    hold = Hold()
    cpu = SlowCpu(8 * BLOCK, hold)
    with TieredStore([(cpu, LevelOptions())]) as s:
        s.put(_k(0), _v(0))
        cpu.slow_key = _k(1)
        putter, put_done, _ = _in_thread(lambda: s.put(_k(1), _v(1)))
        assert hold.entered.wait(WAIT_S)
        getter, got, out = _in_thread(lambda: s.get(_k(0)))
        try:
            assert got.wait(WAIT_S), "a get waited behind another key's put"
            assert out == [_v(0)] and not put_done.is_set()  # the put is still inside its copy
            assert s.get(_k(1)) is None  # not stored until its copy is done
        finally:
            hold.release.set()
        assert put_done.wait(WAIT_S) and s.get(_k(1)) == _v(1)


def test_a_get_completes_while_a_promotion_is_held_in_its_copy(tmp_path: Path) -> None:
    hold = Hold()
    cpu = SlowCpu(2 * BLOCK, hold)
    with TieredStore([(cpu, LevelOptions()), (DiskTier(tmp_path / "d", 64 * BLOCK), LevelOptions())]) as s:
        for i in range(3):  # k0 is pushed down to disk
            s.put(_k(i), _v(i))
        s.flush()
        assert s.lookup([_k(0)]).tiers == ["disk"]
        cpu.slow_key = _k(0)
        reader, read_done, out = _in_thread(lambda: s.get(_k(0)))  # a disk hit, promoted: held in its copy
        assert hold.entered.wait(WAIT_S)
        getter, got, other = _in_thread(lambda: s.get(_k(2)))
        try:
            assert got.wait(WAIT_S), "a get waited behind another key's promotion"
            assert other == [_v(2)] and not read_done.is_set()
        finally:
            hold.release.set()
        assert read_done.wait(WAIT_S) and out == [_v(0)]


def test_a_lookup_asks_a_shared_tier_without_the_store_lock(tmp_path: Path) -> None:
    disk = HeldContains(tmp_path / "d", 64 * BLOCK)
    with TieredStore([(CpuTier(8 * BLOCK, shared=False), LevelOptions()),
                      (disk, LevelOptions(shared=True))]) as s:  # fmt: skip
        s.put(_k(0), _v(0))
        disk.hold = hold = Hold()
        looker, looked, res = _in_thread(lambda: s.lookup([_k(0), *(_k(i) for i in range(1, 100))]))
        assert hold.entered.wait(WAIT_S)
        getter, got, out = _in_thread(lambda: s.get(_k(0)))
        try:
            assert got.wait(WAIT_S), "a get waited behind a lookup's question to a shared tier"
            assert out == [_v(0)] and not looked.is_set()
        finally:
            hold.release.set()
        assert looked.wait(WAIT_S) and res[0].prefix_len == 1
