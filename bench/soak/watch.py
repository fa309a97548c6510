"""The soak's watcher: memory, open files, threads and shared memory of each process, every few seconds.

Why each process *identity* (role, pid, start time) and not each role: a daemon SIGKILLed and
restarted is a new process, and its figures start from zero again; comparing the first
daemon's warm-up with the last daemon's end mixes two processes (growth that is no growth, or
a leak hidden by a restart). The figures (bench/soak/figures.py) compare each identity with
itself only.

Why RSS is split (``/proc/PID/status``): ``RssAnon`` is the heap — where a leak shows;
``RssFile`` is file pages mapped (lmdb's map of the disk tier: page cache that grows with the
blocks read, bounded by the file); ``RssShmem`` is shared memory touched (the engines'
segments, mapped on both sides). ``shm`` counts the bytes of client segments mapped (memfds named
``tierkv-seg-*``, and any /dev/shm file), by inode, so a segment mapped by two processes counts once; ``lmdb`` is the part of ``RssFile`` in lmdb maps.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

PROC = Path("/proc")


class Sample(NamedTuple):
    t: float  # seconds since the watcher started
    role: str
    pid: int
    start: int  # the process's start time (clock ticks since boot): with pid, its identity
    rss: int  # bytes
    anon: int
    file: int
    shmem: int
    fds: int
    threads: int
    shm: dict[int, int]  # segment inode -> bytes mapped
    lmdb: int = 0  # bytes of RSS in lmdb maps (*.mdb): the disk tier's pages, part of ``file``
    queued: int = 0  # bytes the process says it holds in transit (the daemon: its spill queue), part of ``anon``

    @property
    def identity(self) -> str:
        return f"{self.role}/{self.pid}/{self.start}"


def sample(role: str, pid: int, t: float) -> Sample | None:
    """One reading of ``pid``, or None if it is gone."""
    base = PROC / str(pid)
    try:
        stat = (base / "stat").read_text()
        status = dict(line.split(":", 1) for line in (base / "status").read_text().splitlines() if ":" in line)
        fds = len(os.listdir(base / "fd"))
        maps = (base / "maps").read_text()
    except (OSError, ValueError):
        return None
    kb = {k: int(v.split()[0]) * 1024 for k, v in status.items() if v.strip().endswith("kB")}
    shm: dict[int, int] = {}
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith(("/dev/shm/", "/memfd:tierkv-seg-")):
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            shm[int(parts[4])] = shm.get(int(parts[4]), 0) + hi - lo
    return Sample(t, role, pid, int(stat.rsplit(")", 1)[1].split()[19]), kb.get("VmRSS", 0), kb.get("RssAnon", 0),
                  kb.get("RssFile", 0), kb.get("RssShmem", 0), fds, int(status["Threads"]), shm,
                  _lmdb_rss(base) if ".mdb" in maps else 0)  # fmt: skip


def _lmdb_rss(base: Path) -> int:
    """RSS of the process's lmdb maps, from smaps (read only when maps shows one)."""
    total, in_mdb = 0, False
    try:
        text = (base / "smaps").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line[:1].isdigit() or line[:1] in "abcdef" and "-" in line.split(" ", 1)[0]:
            in_mdb = line.rstrip().endswith(".mdb")
        elif in_mdb and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


class Watcher:
    """Samples every process ``processes()`` names (role -> pid, None while down) every ``every_s``."""

    def __init__(self, processes: Callable[[], dict[str, int | None]], every_s: float = 2.0,
                 queued: Callable[[str], int] | None = None) -> None:  # fmt: skip
        """``queued(role)``: bytes that process reports holding in transit now (0 if unknown)."""
        self.processes, self.every_s, self.queued = processes, every_s, queued
        self.samples: list[Sample] = []
        self.marks: dict[str, float] = {}  # phase name -> time (same clock as samples)
        self._t0 = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-watch", daemon=True)

    def now(self) -> float:
        return time.monotonic() - self._t0

    def mark(self, name: str) -> None:
        self.marks[name] = self.now()

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.take()  # a last reading of everything still alive

    def take(self) -> None:
        t = self.now()
        for role, pid in self.processes().items():
            if pid is not None and (s := sample(role, pid, t)) is not None:
                self.samples.append(s._replace(queued=self.queued(role)) if self.queued is not None else s)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.take()
