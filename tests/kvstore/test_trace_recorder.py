"""The access trace (kvstore/ops/trace.py): what TieredStore records, the ring's bound, the file format."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from kvstore.ops.trace import (
    MAGIC,
    MISS,
    TraceControl,
    TraceError,
    TraceRecorder,
    key_hash,
    read_trace,
    write_trace,
)
from kvstore.store.observers import OP_GET, OP_LOOKUP, OP_PUT
from kvstore.store.tier_bookkeeping import LevelOptions
from kvstore.store.tiered_store import TieredStore
from tests.kvstore.support import blk
from tiers.cpu import CpuTier
from tiers.disk import DiskTier


def test_store_records_each_access_with_the_tier_that_held_it(tmp_path: Path) -> None:
    one = len(blk(b"a"))
    store = TieredStore([(CpuTier(one, pinned=False), LevelOptions()),
                         (DiskTier(tmp_path / "d", 8 * one, sync=False), LevelOptions())])  # fmt: skip
    try:
        store.put(b"a", blk(b"a"))  # untraced: nothing is recorded while off
        rec = TraceRecorder(100)
        store.access = rec
        store.put(b"b", blk(b"b"))  # new: stored at the top, a spills to disk
        store.flush()
        store.put(b"b", blk(b"b"))  # already held, at the top
        store.get(b"a")  # a disk hit (promoted)
        store.get(b"zz")  # a miss
        store.lookup([b"a", b"zz"])
        store.access = None
        store.get(b"a")
        r = rec.records()
    finally:
        store.close()
    assert r["op"].tolist() == [OP_PUT, OP_PUT, OP_GET, OP_GET, OP_LOOKUP, OP_LOOKUP]
    assert r["tier"].tolist() == [MISS, 0, 1, MISS, 0, MISS]
    assert r["size"].tolist() == [one, one, one, 0, 0, 0]
    assert r["key"].tolist() == [int.from_bytes(key_hash(k), "little") for k in (b"b", b"b", b"a", b"zz", b"a", b"zz")]
    assert (np.diff(r["t"]) >= 0).all()


def test_ring_keeps_the_latest_records_and_counts_the_rest() -> None:
    rec = TraceRecorder(4)
    for i in range(10):
        rec(OP_GET, b"k%d" % i, i, 0)
    r = rec.records()
    assert r["size"].tolist() == [6, 7, 8, 9] and rec.overwritten == 6
    with pytest.raises(TraceError, match="max_records"):
        TraceRecorder(0)


def test_control_writes_a_file_that_reads_back(tmp_path: Path) -> None:
    store = TieredStore([(CpuTier(1 << 20, pinned=False), LevelOptions(eviction="s3fifo"))])
    control = TraceControl(store, tmp_path)
    try:
        out = tmp_path / "t.kvtrace"
        assert control.start(str(out), max_records=10) == str(out)
        with pytest.raises(TraceError, match="already running"):
            control.start(str(tmp_path / "other.kvtrace"))
        store.put(b"a", blk(b"a"))
        assert store.get(b"a") is not None
        assert control.stop() == (str(out), 2, 0)
        assert store.access is None
        with pytest.raises(TraceError, match="no trace is running"):
            control.stop()
        with pytest.raises(TraceError, match="already exists"):  # never replaces a file
            control.start(str(out))
        with pytest.raises(TraceError, match="absolute path"):
            control.start("relative.kvtrace")
        with pytest.raises(TraceError, match="no directory"):
            control.start(str(tmp_path / "missing" / "t.kvtrace"))
        default = control.start()
        control.stop()
        assert Path(default).parent == tmp_path and Path(default).exists()
    finally:
        store.close()
    t = read_trace(out)
    assert [(x.name, x.capacity_bytes, x.eviction) for x in t.tiers] == [("cpu", 1 << 20, "s3fifo")]
    assert t.records["op"].tolist() == [OP_PUT, OP_GET] and t.records["tier"].tolist() == [MISS, 0]


def _valid(tmp_path: Path) -> bytes:
    rec = TraceRecorder(8)
    rec(OP_PUT, b"a", 10, None)
    path = tmp_path / "ok.kvtrace"
    write_trace(path, {"tiers": [{"name": "cpu", "capacity_bytes": 100}]}, rec.records())
    return path.read_bytes()


@pytest.mark.parametrize(
    "mangle, message",
    [
        (lambda b: b"not a trace at all", "not a tierkv trace"),
        (lambda b: b[:-5], "truncated trace"),
        (lambda b: MAGIC + struct.pack("<I", 5) + b"{bad}", "bad trace header"),
        (lambda b: b.replace(b'"version": 1', b'"version": 9'), "format version 9"),
        (lambda b: b[:-24] + bytes(8) + struct.pack("<IBBHd", 1, 7, 0, 0, 0.0), "unknown op or tier"),
        (lambda b: b[:-24] + bytes(8) + struct.pack("<IBBHd", 1, 0, 3, 0, 0.0), "unknown op or tier"),
    ],
)
def test_bad_trace_file_is_one_clear_error(tmp_path: Path, mangle, message: str) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.kvtrace"
    bad.write_bytes(mangle(_valid(tmp_path)))
    with pytest.raises(TraceError, match=message) as e:
        read_trace(bad)
    assert "\n" not in str(e.value)
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "absent.kvtrace")
