"""How busy this process's cores are with other processes' work, and waiting for them to be quiet.

Start-up timings (connector/calibrate.py's prefill model, engine/cpu_gemm.py's choice of form) are
only as good as the cores they ran on were free: engines started together on one host (compose's
two replicas, a node's pods after a restart) time against each other. Three SmolLM2 engines starting at once on 2
cores each took 44-46 s to calibrate instead of 5 s and fitted a 0.94-1.09 s fixed prefill cost
instead of 0.13 s, beyond what the online correction can take back (its samples are clamped to
4x, connector/cost_model.py), and two of three chose F.linear for small steps where a lone engine
chooses the mm form, a decode step ~2x slower for their whole life.

``others_share`` is the CPU time the cores this process may run on (its affinity mask) spent busy
in the window, less this process's own CPU time, over the window's length times those cores: 0 on
an idle machine, ~0.7 with two other 2-thread engines on 2 cores. From Linux's /proc/stat per-CPU
counters (clock ticks: ~10 ms resolution, so windows of a few hundred ms and more) and the
process's own CPU time; where /proc/stat cannot be read, ``open`` gives None and nothing waits.

``QuietCores`` is the waiting, within one budget: ``wait`` until other processes leave enough of the
cores free for the engine's threads (``THREAD_SLACK``), in jittered pauses, a quiet look confirmed
by a second one after a random pause (engines waiting for each other all see quiet cores at once,
each only looking, and would start together: without it two of three engines started at once
timed 14 runs each on shared cores, bench.calibrate_together); ``timed`` runs a timing and says
whether its cores were quiet meanwhile.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

_STAT = Path("/proc/stat")
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (idle and iowait are not busy)
T = TypeVar("T")

#: quiet enough: the cores other processes leave free number at least the engine's threads less
#: this (and at most 3/4 of its cores are asked for): with 2 threads on 2 cores, others may take a
#: quarter of them; with 1 thread there, one whole core is its own; with 2 threads on a 64-core
#: node, a busy node is still quiet enough
THREAD_SLACK = 0.5
#: how long one look at the cores lasts, and the jittered pause after a busy one (engines started
#: together then do not all look again at the same moment)
LOOK_S = 0.15
PAUSE_S = (0.25, 1.0)
#: the random pause before the look that confirms a quiet one
CONFIRM_PAUSE_S = 0.3
#: the most one start-up timing waits, all told, for quiet cores by default (the connector's
#: ``calibrate_quiet_wait_s``, the engine's ``cpu_gemm_quiet_wait_s``): past it, cores kept busy
#: are the engine's lot, and what it times there is what its requests will pay
QUIET_WAIT_S = 20.0


class CoreLoad:
    def __init__(self, cpus: set[int], stat: Path = _STAT) -> None:
        self.cpus, self.stat = cpus, stat
        self.tick = os.sysconf("SC_CLK_TCK")
        self._mark = self._read()

    @staticmethod
    def for_timing(device_type: str, wait_s: float) -> CoreLoad | None:
        """The cores to read around a start-up timing on ``device_type``: none on a GPU (its work
        does not run on them) or when the timing may not wait (``wait_s`` 0)."""
        return CoreLoad.open() if device_type == "cpu" and wait_s > 0 else None

    @staticmethod
    def open(stat: Path = _STAT) -> CoreLoad | None:
        """None where the per-CPU counters cannot be read (not Linux, /proc not mounted)."""
        try:
            cpus = os.sched_getaffinity(0)
            load = CoreLoad(cpus, stat)
        except (OSError, ValueError, AttributeError):
            return None
        return load if load._mark[0] is not None else None

    def _read(self) -> tuple[float | None, float, float]:
        """(busy seconds of our cores, this process's CPU seconds, monotonic seconds)."""
        busy = 0.0
        seen = 0
        try:
            for line in self.stat.read_text().splitlines():
                name, _, rest = line.partition(" ")
                if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in self.cpus:
                    continue
                f = rest.split()
                busy += sum(int(f[i]) for i in _BUSY_FIELDS if i < len(f))
                seen += 1
        except (OSError, ValueError):
            return None, 0.0, time.monotonic()
        return (busy / self.tick if seen else None), time.process_time(), time.monotonic()

    def mark(self) -> None:
        """Start a window."""
        self._mark = self._read()

    def others_share(self) -> float | None:
        """Other processes' share of our cores since ``mark`` (0..1; None: unreadable or too short a
        window to tell). Starts the next window."""
        (b0, c0, t0), now = self._mark, self._read()
        self._mark = now
        b1, c1, t1 = now
        if b0 is None or b1 is None or t1 - t0 < 2.0 / self.tick:
            return None
        others = (b1 - b0) - (c1 - c0)
        return min(1.0, max(0.0, others / ((t1 - t0) * len(self.cpus))))


class QuietCores:
    """Waits for quiet cores within ``budget_s`` in all (module doc); ``load`` None: never waits."""

    def __init__(self, load: CoreLoad | None, budget_s: float, threads: int,
                 sleep: Callable[[float], None] = time.sleep, rng: random.Random | None = None) -> None:
        self.load, self.left, self.sleep, self.rng = load, budget_s, sleep, rng or random.Random()
        self.waited_s = 0.0
        self.contended = 0  # timings that shared their cores
        cores = len(load.cpus) if load is not None else 1
        self.need = min(max(threads - THREAD_SLACK, THREAD_SLACK), 0.75 * cores)  # free cores wanted

    def _quiet(self, share: float | None) -> bool:
        return share is None or (1.0 - share) * len(self.load.cpus) >= self.need  # type: ignore[union-attr]

    def wait(self) -> bool:
        """Until the cores are quiet (True) or the budget is spent (False)."""
        if self.load is None:
            return True
        quiet_looks = 0
        while True:
            self.load.mark()
            self.sleep(LOOK_S)
            share = self.load.others_share()
            self._spend(LOOK_S)
            if self._quiet(share):
                quiet_looks += 1
                if quiet_looks == 2:
                    return True
                pause = self.rng.uniform(0.0, CONFIRM_PAUSE_S)
            else:
                quiet_looks = 0
                if self.left <= 0:
                    return False
                pause = self.rng.uniform(*PAUSE_S)
            self._spend(pause)
            self.sleep(pause)

    def _spend(self, s: float) -> None:
        self.left -= s
        self.waited_s += s

    def timed(self, fn: Callable[[], T]) -> tuple[T, bool]:
        """(``fn()``, whether the cores were quiet meanwhile)."""
        if self.load is None:
            return fn(), True
        self.load.mark()
        out = fn()
        quiet = self._quiet(self.load.others_share())
        self.contended += not quiet
        return out, quiet
