"""bench.e2e's "disk" is the device, not the page cache: ``DiskCooler`` evicts the disk daemon's
lmdb files (bench/cold_disk.py: its mappings paged out, the files dropped, mincore checked) before
every daemon_disk point, and says in the JSON how and whether it worked (``summary``).

A point is one timed request of the headline, one option measured in a cost-model case, or one
whole workload configuration (its own offloads during the run then sit in the page cache, as
they would on any machine)."""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.cold_disk import ColdResult, evict, lmdb_files


class DiskCooler:
    def __init__(self, address: str, lmdb_dir: Path, pid: int, global_drop: bool = False) -> None:
        self.address, self.lmdb_dir, self.pid, self.global_drop = address, Path(lmdb_dir), pid, global_drop
        self.results: list[ColdResult] = []

    def before(self, address: str) -> None:
        """Called before every timed point of any daemon: evicts when it is the disk daemon's."""
        if address == self.address:
            self.results.append(evict(lmdb_files(self.lmdb_dir), [self.pid], global_drop=self.global_drop))

    def summary(self) -> dict:
        r = self.results
        return {
            "disk_cold_method": r[-1].method if r else "none (no disk point ran)",
            "disk_cold_points": len(r),
            "disk_cold_verified": bool(r) and all(x.verified for x in r),
            "disk_resident_before_median": statistics.median(x.resident_before for x in r) if r else None,
            "disk_resident_after_max": max(x.resident_after for x in r) if r else None,
        }
