"""The connector's counters: what both halves count, drained into vLLM's stats at every step.

vLLM collects ``get_kv_connector_stats()`` from the worker and from the scheduler each step,
adds them up (``aggregate``) and hands the sum to the API server process, where
``TierKVPromMetrics`` (connector/vllm/stats.py) turns them into Prometheus counters on vLLM's own
/metrics. So a counter here is a delta since the last drain, keyed ``name`` or ``name:label``.

=========================  =================================================================
key                        meaning
=========================  =================================================================
blocks:looked_up           blocks asked of the daemon beyond vLLM's local prefix hit
blocks:held                of those, the leading run the daemon holds
blocks:loaded              blocks copied into vLLM's blocks and verified
blocks:saved               blocks written to the daemon (new to it)
blocks:save_skipped        full blocks not sent: the daemon already held them
blocks:save_dropped        full blocks not sent: the save queue was full or the daemon failed
failed:REASON              blocks a load gave back to vLLM to recompute, by reason
bytes:loaded / bytes:saved block bytes moved
load_seconds / loads       time of the loads (lookup excluded) and their number
sync_loads                 of those, loads run inside the step (planner: ``sync_load_max_s``)
decisions:OUTCOME          cost-model decisions per request (load_all, load_partial,
                           recompute, uncalibrated, none_held)
lookup_errors              lookups that failed (the request recomputes)
=========================  =================================================================
"""

from __future__ import annotations

import threading
from collections import defaultdict


class Counters:
    def __init__(self) -> None:
        self._data: defaultdict[str, float] = defaultdict(float)
        self._lock = threading.Lock()

    def add(self, key: str, n: float = 1) -> None:
        if n:
            with self._lock:
                self._data[key] += n

    def take(self) -> dict[str, float]:
        """Everything counted since the last ``take`` (and forget it)."""
        with self._lock:
            out, self._data = dict(self._data), defaultdict(float)
        return out
