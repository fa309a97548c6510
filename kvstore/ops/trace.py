"""A bounded, compact trace of the TieredStore's accesses, for sizing tiers (``kvstore advise``).

Turned on and off at run time (``kvstore trace start|stop``, two authenticated RPCs). While off
the store pays one ``is None`` test per call. While on, each access appends one fixed-size record
to a ring of ``max_records`` (the oldest are overwritten: the trace keeps the latest window, and
says how many records it lost); ``stop`` writes the ring to the file named at ``start``, which
the daemon creates (never overwrites) on its own host.

Bounds: the ring is at most the daemon's ``trace_max_records`` (allocated at start, 24 bytes a
record), and the file is written only in its traces directory (``traces_dir``): a caller names a
file in it, never a path elsewhere (no other directory, no ``..``), and the file is created
through a descriptor of that directory opened at start, with O_NOFOLLOW and O_EXCL, so a
symlink put there (or swapped in for the directory later) is refused, not followed.

File format (little-endian), version 1::

    magic     8 bytes   b"TKVTRACE"
    hlen      u32       length of the JSON header that follows
    header    hlen bytes UTF-8 JSON: {"version": 1, "tiers": [{"name", "capacity_bytes",
                        "eviction"}, ...] (the chain, fastest first), "promote_on_hit",
                        "started_unix", "max_records", "records", "overwritten"}
    records   records x 24 bytes, oldest first:
                key   8 bytes  BLAKE2b-64 of the block key (keys are not kept, only their hash)
                size  u32      block bytes (0 when unknown: a lookup, a miss)
                op    u8       0 get, 1 put, 2 lookup
                tier  u8       index in "tiers" of the tier that held the key, 255 = none held it
                               (a get or lookup that missed; a put that stored a new block)
                pad   u16      0
                t     f64      seconds since "started_unix"
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from dataclasses import dataclass
from hashlib import blake2b
from pathlib import Path
from typing import Any

import numpy as np

from kvstore.errors import KVStoreError
from kvstore.store.observers import OP_LOOKUP

MAGIC = b"TKVTRACE"
VERSION = 1
OP_NAMES = ("get", "put", "lookup")
MISS = 255
RECORD = struct.Struct("<8sIBBHd")
RECORD_DTYPE = np.dtype([("key", "<u8"), ("size", "<u4"), ("op", "u1"), ("tier", "u1"), ("pad", "<u2"),
                         ("t", "<f8")])  # fmt: skip
DEFAULT_MAX_RECORDS = 1_000_000  # 24 MB of ring
MAX_RECORDS = 100_000_000  # 2.4 GB: the most one trace may hold in memory
assert RECORD.size == RECORD_DTYPE.itemsize == 24


class TraceError(KVStoreError):
    """A trace cannot be started, stopped or read (bad file, already running, not running)."""


def key_hash(key: bytes) -> bytes:
    return blake2b(key, digest_size=8).digest()


class TraceRecorder:
    """A ring of ``max_records`` fixed-size records; thread-safe ``__call__`` is the hot path."""

    def __init__(self, max_records: int = DEFAULT_MAX_RECORDS) -> None:
        if not 1 <= max_records <= MAX_RECORDS:
            raise TraceError(f"max_records must be in 1..{MAX_RECORDS}, got {max_records}")
        self.max_records = max_records
        self._buf = bytearray(max_records * RECORD.size)
        self._n = 0  # records ever appended
        self._lock = threading.Lock()
        self.started_unix = time.time()
        self._t0 = time.perf_counter()

    def __call__(self, op: int, key: bytes, size: int, level: int | None) -> None:
        t = time.perf_counter() - self._t0
        tier = MISS if level is None else min(level, MISS - 1)
        with self._lock:
            RECORD.pack_into(self._buf, (self._n % self.max_records) * RECORD.size, key_hash(key),
                             min(size, 0xFFFFFFFF), op, tier, 0, t)  # fmt: skip
            self._n += 1

    @property
    def overwritten(self) -> int:
        return max(0, self._n - self.max_records)

    def records(self) -> np.ndarray:
        """The ring's records, oldest first (a copy)."""
        with self._lock:
            n, cap = self._n, self.max_records
            arr = np.frombuffer(bytes(self._buf), dtype=RECORD_DTYPE)
        if n <= cap:
            return arr[:n].copy()
        start = n % cap
        return np.concatenate([arr[start:], arr[:start]])


@dataclass(frozen=True)
class TraceTier:
    name: str
    capacity_bytes: int
    eviction: str = "lru"


@dataclass(frozen=True)
class Trace:
    """A trace read back: the chain it was taken on, and its records (numpy, RECORD_DTYPE)."""

    tiers: tuple[TraceTier, ...]
    promote_on_hit: bool
    records: np.ndarray
    overwritten: int = 0

    @property
    def duration_s(self) -> float:
        return float(self.records["t"][-1] - self.records["t"][0]) if len(self.records) > 1 else 0.0


def write_trace(path: str | Path, header: dict[str, Any], records: np.ndarray, dir_fd: int | None = None) -> None:
    """Write a trace file; refuses to replace an existing file (O_EXCL) or to follow a symlink
    (O_NOFOLLOW). ``dir_fd``: ``path`` is a name in that open directory."""
    head = json.dumps(dict(header, version=VERSION, records=len(records))).encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    except OSError as e:
        raise TraceError(f"cannot create trace file {path}: {e.strerror or e}") from None
    with os.fdopen(fd, "wb") as f:
        f.write(MAGIC + struct.pack("<I", len(head)) + head)
        f.write(records.astype(RECORD_DTYPE, copy=False).tobytes())


def read_trace(path: str | Path) -> Trace:
    """Parse a trace file; every defect is one TraceError naming the file and what is wrong."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror or e}") from None
    if raw[:8] != MAGIC or len(raw) < 12:
        raise TraceError(f"{path} is not a tierkv trace (no {MAGIC.decode()} magic)")
    (hlen,) = struct.unpack_from("<I", raw, 8)
    try:
        head = json.loads(raw[12 : 12 + hlen])
        tiers = tuple(TraceTier(str(t["name"]), int(t["capacity_bytes"]), str(t.get("eviction", "lru")))
                      for t in head["tiers"])  # fmt: skip
        n, version = int(head["records"]), int(head["version"])
    except (ValueError, KeyError, TypeError) as e:
        raise TraceError(f"{path}: bad trace header ({type(e).__name__}: {e})") from None
    if version != VERSION:
        raise TraceError(f"{path}: trace format version {version}, this kvstore reads {VERSION}")
    body = raw[12 + hlen :]
    if len(body) != n * RECORD.size:
        raise TraceError(f"{path}: truncated trace ({len(body)} bytes of records, header says {n} x {RECORD.size})")
    recs = np.frombuffer(body, dtype=RECORD_DTYPE)
    bad_tier = (recs["tier"] != MISS) & (recs["tier"] >= len(tiers))
    if (recs["op"] > OP_LOOKUP).any() or bad_tier.any():
        raise TraceError(f"{path}: corrupt records (unknown op or tier index)")
    return Trace(tiers, bool(head.get("promote_on_hit", True)), recs, int(head.get("overwritten", 0)))


class TraceControl:
    """Starts and stops the trace of one TieredStore (what the TraceStart/TraceStop RPCs call).

    ``traces_dir``: the one directory trace files go in (made 0700 if missing);
    ``max_records``: the largest ring a start may ask for."""

    def __init__(self, store: Any, traces_dir: Path, max_records: int = MAX_RECORDS) -> None:
        self._store = store
        self._dir = Path(traces_dir)
        self._max_records = max_records
        self._lock = threading.Lock()
        self._rec: TraceRecorder | None = None
        self._out: Path | None = None
        self._dir_fd: int | None = None

    def _name(self, out: str) -> str:
        """The file name ``out`` asks for in the traces directory; TraceError for anything else."""
        if not out:
            return time.strftime("trace-%Y%m%d-%H%M%S.kvtrace", time.gmtime())
        if "\0" in out or len(out) > 4096:
            raise TraceError(f"bad trace file name {out[:64]!r}")
        p = Path(out)
        if p.is_absolute():
            if ".." in p.parts or os.path.normpath(p.parent) != os.path.normpath(self._dir.absolute()):
                raise TraceError(f"{out[:200]!r} is not in the daemon's traces directory {self._dir}: trace files "
                                 "are written only there")
            name = p.name
        elif len(p.parts) == 1 and out not in (".", ".."):
            name = out
        else:
            raise TraceError(f"{out[:200]!r} is not a file name: trace files are written only in the daemon's "
                             f"traces directory {self._dir} (give a name, or a path in it)")
        if len(name.encode()) > 255:
            raise TraceError(f"trace file name of {len(name.encode())} bytes (max 255)")
        return name

    def start(self, out: str = "", max_records: int = 0) -> str:
        """Begin recording; returns the file that ``stop`` will write (``out``: a name in the traces
        directory, or an absolute path in it; "" = a new name there)."""
        with self._lock:
            if self._rec is not None:
                raise TraceError(f"a trace is already running (to {self._out}); stop it first")
            n = max_records or min(DEFAULT_MAX_RECORDS, self._max_records)
            if not 1 <= n <= self._max_records:
                raise TraceError(f"max_records must be in 1..{self._max_records} on this daemon, got {n}")
            name = self._name(out)
            try:
                self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
                dir_fd = os.open(self._dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            except OSError as e:
                raise TraceError(f"cannot open the traces directory {self._dir}: {e.strerror or e}") from None
            try:
                os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                pass
            except OSError as e:
                os.close(dir_fd)
                raise TraceError(f"cannot write a trace file {name!r}: {e.strerror or e}") from None
            else:
                os.close(dir_fd)
                raise TraceError(f"trace file {self._dir / name} already exists (a trace never replaces a file)")
            self._rec = TraceRecorder(n)
            self._out, self._dir_fd = self._dir / name, dir_fd
            self._store.access = self._rec
            return str(self._out)

    def stop(self) -> tuple[str, int, int]:
        """Stop recording and write the file: (path, records written, records overwritten)."""
        with self._lock:
            rec, path, dir_fd = self._rec, self._out, self._dir_fd
            if rec is None or path is None or dir_fd is None:
                raise TraceError("no trace is running")
            self._store.access = None
            self._rec = self._out = self._dir_fd = None
        try:
            recs = rec.records()
            write_trace(path.name, {"tiers": [{"name": lv.name, "capacity_bytes": lv.capacity,
                                               "eviction": lv.options.eviction} for lv in self._store.levels],
                                    "promote_on_hit": self._store.promote_on_hit, "started_unix": rec.started_unix,
                                    "max_records": rec.max_records, "overwritten": rec.overwritten},
                        recs, dir_fd=dir_fd)  # fmt: skip
        finally:
            os.close(dir_fd)
        return str(path), len(recs), rec.overwritten
