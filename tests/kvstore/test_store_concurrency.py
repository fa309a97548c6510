"""Reads copy outside the store lock, and what they read is pinned while they read it.

Why: the daemon serves many clients from threads; with every copy under one lock, clients were
served one at a time. A reader now holds only its source (the cpu tier's lease on an arena run)
while it copies, so writers, evictions and deletes go on meanwhile and never reuse those bytes.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from kvstore.block import decode_block, encode_block
from kvstore.store.tier_bookkeeping import LevelOptions
from kvstore.store.tiered_store import TieredStore
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
