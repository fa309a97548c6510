"""How busy this process's cores are with other processes' work, between two reads.

The start-up prefill timings (connector/calibrate.py) are only as good as the cores they ran on
were free: engines started together on one host (compose's two replicas, a node's pods after a
restart) time their prefills against each other. Three SmolLM2 engines starting at once on 2
cores each took 44-46 s to calibrate instead of 5 s and fitted a 0.94-1.09 s fixed prefill cost
instead of 0.13 s, beyond what the online correction can take back (its samples are clamped to
4x, connector/cost_model.py).

``others_share`` is the CPU time the cores this process may run on (its affinity mask) spent busy
in the window, less this process's own CPU time, over the window's length times those cores: 0 on
an idle machine, ~0.7 with two other 2-thread engines on 2 cores. From Linux's /proc/stat per-CPU
counters (clock ticks: ~10 ms resolution, so windows of a few hundred ms and more) and the
process's own CPU time; where /proc/stat cannot be read, ``open`` gives None and nothing waits.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_STAT = Path("/proc/stat")
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal (idle and iowait are not busy)


class CoreLoad:
    def __init__(self, cpus: set[int], stat: Path = _STAT) -> None:
        self.cpus, self.stat = cpus, stat
        self.tick = os.sysconf("SC_CLK_TCK")
        self._mark = self._read()

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
