"""Circuit breaker per tier, and the background threads that probe detached tiers.

Why: a tier whose server is down (or hung) must not cost every request a timeout. After
``failures`` consecutive errors a tier is *detached*: the store skips it (reads miss there and
fall through, writes meant for it are skipped and counted), and no request waits on it any
more. A background thread of its own then probes it (``Tier.probe``: PING, HEAD bucket) after
``probe_s``, doubling the wait up to ``probe_max_s`` while it keeps failing, and *attaches* it
again on the first answer. A tier that cannot be reached when the store starts begins detached,
so the daemon starts degraded instead of crash-looping while S3 or Redis is down.

Demand brings a probe forward: the backoff alone would find a healed tier only up to
``probe_max_s`` after it heals. A request that wanted a detached tier (a read that missed in every
available level while it might hold the key, a write skipped for it) calls ``Breaker.wanted``,
which moves the next probe to ``demand_s`` after the last one ended, never sooner, and the
prober is woken. So a down server gets at most one probe per ``demand_s`` however busy the store
(the backoff still spaces the probes of a tier nobody asks for), a healed one is attached within
about ``demand_s`` of the next request that wants it, and no request ever waits on a probe: it
runs on the tier's prober thread. When a tier is attached the prober hands its replay backlog (the
keys whose writes it skipped, kvstore/store/replay.py) to ``on_attach``; and while an attached tier
holds a backlog (writes that failed without detaching it: the first writes after a heal, before
the network answers again, bench.cluster's node_partitioned), the prober hands it over again every
``probe_s``, so a backlog never waits for a detach that may not come.

Two rules detach a tier: ``failures`` errors in a row (a server that is down), or an error rate:
at least ``rate`` of its last ``window`` calls failed, once the window holds ``min_calls`` (a
server that fails every other call: a success between errors resets the run of errors but not
the rate, so such a tier is detached instead of costing every second request a timeout). A
single timeout on a busy network detaches nothing; a refusal for lack of room (TierFull) is not
a failure at all (Level.fail).

The breaker holds state only; the store's lock guards it (like the rest of a Level). The prober
calls the tier outside that lock, on a thread per tier, so a probe of a hung server blocks nobody
but that tier's prober thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvstore.store.tier_bookkeeping import Level

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BreakerPolicy:
    failures: int = 3  # consecutive errors that detach a tier
    probe_s: float = 2.0  # first probe this long after detaching
    probe_max_s: float = 20.0  # the wait doubles per failed probe, up to this
    window: int = 20  # the error rate is taken over the tier's last ``window`` calls ...
    rate: float = 0.5  # ... and detaches it when at least this share of them failed ...
    min_calls: int = 10  # ... once the window holds at least this many calls
    demand_s: float = 0.1  # a request that wants a detached tier brings its probe forward to this long after the last

    def __post_init__(self) -> None:
        if self.failures < 1 or self.probe_s <= 0 or self.probe_max_s < self.probe_s or self.demand_s <= 0:
            raise ValueError(f"bad breaker policy {self} (failures >= 1, 0 < probe_s <= probe_max_s, demand_s > 0)")
        if not 1 <= self.min_calls <= self.window or not 0 < self.rate <= 1:
            raise ValueError(f"bad breaker policy {self} (1 <= min_calls <= window, 0 < rate <= 1)")

    @classmethod
    def from_retry(cls, retry_s: float, failures: int = 3, **rate: float) -> BreakerPolicy:
        """The store's ``tier_retry_s`` is the first probe's delay; backoff caps at 10x it.
        ``rate``: ``window``, ``rate``, ``min_calls`` (defaults above)."""
        return cls(failures=failures, probe_s=retry_s, probe_max_s=10 * retry_s, **rate)  # type: ignore[arg-type]


class Breaker:
    """Attached or detached, with the count of consecutive failures, the outcomes of the last
    calls (the error rate), and the next probe time."""

    def __init__(self, policy: BreakerPolicy | None = None) -> None:
        self.policy = policy or BreakerPolicy()
        self.attached = True
        self.failures = 0
        self.next_probe = 0.0  # monotonic time of the next probe, while detached
        self.wait_s = self.policy.probe_s  # the wait before it (doubles per failed probe)
        self.probed_at = 0.0  # monotonic time the last probe ended (or the tier was detached)
        self._window: deque[bool] = deque(maxlen=self.policy.window)  # True: that call failed
        self._errors = 0  # failed calls in the window
        self.why = ""  # what detached it last

    @property
    def settled(self) -> bool:
        """Whether a success would change nothing: no errors lately and a full window of
        successes (the store then records it without taking its lock)."""
        return not self.failures and not self._errors and len(self._window) == self.policy.window

    def _record(self, error: bool) -> None:
        if len(self._window) == self.policy.window:
            self._errors -= self._window[0]
        self._window.append(error)
        self._errors += error

    def succeeded(self) -> None:
        self.failures = 0
        self._record(False)

    def failed(self) -> bool:
        """Count one error; True when it detached the tier."""
        if not self.attached:
            return False
        self.failures += 1
        self._record(True)
        p, calls = self.policy, len(self._window)
        if self.failures >= p.failures:
            why = f"{self.failures} consecutive errors"
        elif calls >= p.min_calls and self._errors >= p.rate * calls:
            why = f"{self._errors} errors in its last {calls} calls"
        else:
            return False
        self.detach()
        self.why = why
        return True

    def detach(self) -> None:
        self.attached = False
        self.wait_s = self.policy.probe_s
        self.probed_at = time.monotonic()
        self.next_probe = self.probed_at + self.wait_s
        self.failures, self._errors, self.why = 0, 0, "unreachable"
        self._window.clear()

    def probe_failed(self) -> None:
        self.wait_s = min(self.wait_s * 2, self.policy.probe_max_s)
        self.probed_at = time.monotonic()
        self.next_probe = self.probed_at + self.wait_s

    def wanted(self) -> bool:
        """A request wanted this detached tier: bring its next probe forward to ``demand_s`` after
        the last one ended (never sooner). True when that moved it (the prober must be woken)."""
        if self.attached:
            return False
        earliest = self.probed_at + self.policy.demand_s
        if earliest >= self.next_probe:
            return False
        self.next_probe = earliest
        return True

    def attach(self) -> None:
        self.attached, self.failures, self._errors = True, 0, 0
        self._window.clear()


class Prober:
    """Probes detached levels, each on a daemon thread of its own started on its first detach (or
    its first backlog), so a probe that hangs on one tier (a cut S3 link costs its connect timeout,
    retried) never delays the probe of another that answers again.

    ``on_attach(i, keys)``: called under the store lock as level ``i`` is attached, with the keys
    of its replay backlog, and again every ``probe_s`` while an attached level has a backlog; it
    must not wait (the TieredStore points it at the spill worker's ``replay``, which queues them
    without waiting for room)."""

    def __init__(self, levels: Sequence[Level], lock: threading.RLock) -> None:
        self._levels, self._lock = levels, lock
        self.on_attach: Callable[[int, list[bytes]], None] | None = None
        self._cv = threading.Condition()  # its own lock: wake() is called under the store lock
        self._woken = [False] * len(levels)
        self._closed = False
        self._threads: dict[int, threading.Thread] = {}

    def wake(self) -> None:
        """A level was detached, or a probe brought forward: (start and) wake the threads to
        schedule their probes."""
        with self._cv:
            if self._closed:
                return
            for i, lv in enumerate(self._levels):
                if i not in self._threads and (not lv.available() or len(lv.backlog)):
                    self._threads[i] = threading.Thread(target=self._run, args=(i, lv), daemon=True,
                                                        name=f"tierkv-probe-{lv.name}")
                    self._threads[i].start()
            self._woken = [True] * len(self._levels)
            self._cv.notify_all()

    def close(self, timeout_s: float = 15.0) -> None:
        """Stop probing; waits for the probes in flight (bounded by the tiers' own timeouts)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            threads = list(self._threads.values())
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self, i: int, lv: Level) -> None:
        """Level ``i``'s thread: probe it whenever it is detached and its probe is due; while it is
        attached with a backlog, hand the backlog over ``probe_s`` after the last time."""
        retry_at = time.monotonic() + lv.breaker.policy.probe_s
        while True:
            with self._lock:
                if not lv.available():
                    wait: float | None = lv.breaker.next_probe - time.monotonic()
                else:  # attached: nothing to do but a backlog's retry
                    wait = retry_at - time.monotonic() if len(lv.backlog) else None
            with self._cv:
                if self._closed:
                    return
                if wait is None or wait > 0:
                    if not self._woken[i]:
                        self._cv.wait(wait)
                    self._woken[i] = False
                    continue  # woken (a probe brought forward, a detach), or the wait is over: look again
                self._woken[i] = False
            if not self._retried(i, lv):
                self._probe(i, lv)
            retry_at = time.monotonic() + lv.breaker.policy.probe_s

    def _retried(self, i: int, lv: Level) -> bool:
        """An attached level's backlog handed over again (writes that failed without detaching it);
        False when the level is detached (the probe's turn)."""
        with self._lock:
            if not lv.available():
                return False
            keys = lv.backlog.take()
            if keys and self.on_attach is not None:
                log.info("tier %s: replaying %d write(s) that failed while it stayed attached", lv.name, len(keys))
                self.on_attach(i, keys)
            return True

    def _probe(self, i: int, lv: Level) -> None:
        try:
            lv.tier.probe()
        except Exception as e:  # noqa: BLE001 - any failure keeps the tier detached
            with self._lock:
                lv.probe_failed(e)
            return
        with self._lock:  # the replay is queued as the level is attached: a flush after it waits for it
            lv.attach()
            keys = lv.backlog.take()
            if keys and self.on_attach is not None:
                self.on_attach(i, keys)
