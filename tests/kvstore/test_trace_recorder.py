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
        with pytest.raises(TraceError, match="is not in the daemon's traces directory"):
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


# -- where a trace may be written, and how large its ring may be --------------------------------


def _control(tmp_path: Path, max_records: int = 1000) -> tuple[TieredStore, TraceControl, Path]:
    store = TieredStore([(CpuTier(1 << 20, pinned=False), LevelOptions())])
    traces = tmp_path / "traces"
    return store, TraceControl(store, traces, max_records), traces


def test_a_trace_is_written_only_in_the_traces_directory(tmp_path: Path) -> None:
    store, control, traces = _control(tmp_path)
    try:
        assert control.start("mine.kvtrace") == str(traces / "mine.kvtrace")  # a name: in the directory
        control.stop()
        assert (traces / "mine.kvtrace").exists() and (traces.stat().st_mode & 0o777) == 0o700
        assert control.start(str(traces / "abs.kvtrace")) == str(traces / "abs.kvtrace")  # a path in it
        control.stop()
        for out, why in ((str(tmp_path / "elsewhere.kvtrace"), "is not in the daemon's traces directory"),
                         ("/etc/tierkv.kvtrace", "is not in the daemon's traces directory"),
                         (str(traces / ".." / "traces" / "up.kvtrace"), "is not in the daemon's traces directory"),  # no '..', even back in
                         ("sub/x.kvtrace", "is not a file name"), ("..", "is not a file name"),
                         ("a\x00b", "bad trace file name")):  # fmt: skip
            with pytest.raises(TraceError, match=why):
                control.start(out)
        assert store.access is None and sorted(p.name for p in traces.iterdir()) == ["abs.kvtrace", "mine.kvtrace"]
    finally:
        store.close()


def test_a_symlink_is_never_followed(tmp_path: Path) -> None:
    store, control, traces = _control(tmp_path)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    try:
        traces.mkdir()
        (traces / "link.kvtrace").symlink_to(victim)
        with pytest.raises(TraceError, match="already exists"):  # a link there at start
            control.start("link.kvtrace")
        control.start("late.kvtrace")
        (traces / "late.kvtrace").symlink_to(victim)  # a link put there while the trace runs
        with pytest.raises(TraceError, match="cannot create trace file"):
            control.stop()
        assert victim.read_bytes() == b"keep me"
        real = tmp_path / "real"
        real.mkdir()
        traces.rename(tmp_path / "old")
        traces.symlink_to(real)  # the directory itself swapped for a link
        with pytest.raises(TraceError, match="cannot open the traces directory"):
            control.start("x.kvtrace")
        assert list(real.iterdir()) == []
    finally:
        store.close()


def test_the_ring_is_bounded_by_the_daemons_limit(tmp_path: Path) -> None:
    store, control, _ = _control(tmp_path, max_records=100)
    try:
        with pytest.raises(TraceError, match="max_records must be in 1..100 on this daemon, got 101"):
            control.start("big.kvtrace", max_records=101)
        control.start("small.kvtrace")  # the default ring, cut to the limit
        assert store.access is not None and store.access.max_records == 100
        control.stop()
    finally:
        store.close()

