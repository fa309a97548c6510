"""The daemon's periodic one-line stats summary (``--stats-interval``, 0 = off), on a daemon thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvstore.ops.stats_view import summary_line
from kvstore.store.results import StoreStats

log = logging.getLogger("kvstore.stats")


class StatsLogger:
    """Logs ``summary_line(stats())`` every ``interval_s`` seconds until ``close()``."""

    def __init__(self, stats: Callable[[], StoreStats], interval_s: float) -> None:
        self._stats = stats
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-stats-log", daemon=True)

    def start(self) -> None:
        if self._interval_s > 0:
            self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                log.info("%s", summary_line(self._stats()))
            except Exception as e:  # noqa: BLE001 - a summary must never take the daemon down
                log.warning("stats summary failed: %s", e)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
