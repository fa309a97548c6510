"""Circuit breaker per tier, and the one background thread that probes detached tiers.

Why: a tier whose server is down (or hung) must not cost every request a timeout. After
``failures`` consecutive errors a tier is *detached*: the store skips it (reads miss there and
fall through, writes meant for it are skipped and counted), and no request waits on it any
more. A background thread then probes it (``Tier.probe``: PING, HEAD bucket) after
``probe_s``, doubling the wait up to ``probe_max_s`` while it keeps failing, and *attaches* it
again on the first answer. A tier that cannot be reached when the store starts begins detached,
so the daemon starts degraded instead of crash-looping while S3 or Redis is down.

One success between errors resets the count, so a single timeout on a busy network does not
detach a tier; a refusal for lack of room (TierFull) is not a failure at all (Level.fail).

The breaker holds state only; the store's lock guards it (like the rest of a Level). The prober
calls the tier outside that lock, so a probe of a hung server blocks nobody but the prober.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
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

    def __post_init__(self) -> None:
        if self.failures < 1 or self.probe_s <= 0 or self.probe_max_s < self.probe_s:
            raise ValueError(f"bad breaker policy {self} (failures >= 1, 0 < probe_s <= probe_max_s)")

    @classmethod
    def from_retry(cls, retry_s: float, failures: int = 3) -> BreakerPolicy:
        """The store's ``tier_retry_s`` is the first probe's delay; backoff caps at 10x it."""
        return cls(failures=failures, probe_s=retry_s, probe_max_s=10 * retry_s)


class Breaker:
    """Attached or detached, with the count of consecutive failures and the next probe time."""

    def __init__(self, policy: BreakerPolicy | None = None) -> None:
        self.policy = policy or BreakerPolicy()
        self.attached = True
        self.failures = 0
        self.next_probe = 0.0  # monotonic time of the next probe, while detached
        self.wait_s = self.policy.probe_s  # the wait before it (doubles per failed probe)

    def succeeded(self) -> None:
        self.failures = 0

    def failed(self) -> bool:
        """Count one error; True when it detached the tier."""
        if not self.attached:
            return False
        self.failures += 1
        if self.failures < self.policy.failures:
            return False
        self.detach()
        return True

    def detach(self) -> None:
        self.attached = False
        self.wait_s = self.policy.probe_s
        self.next_probe = time.monotonic() + self.wait_s

    def probe_failed(self) -> None:
        self.wait_s = min(self.wait_s * 2, self.policy.probe_max_s)
        self.next_probe = time.monotonic() + self.wait_s

    def attach(self) -> None:
        self.attached, self.failures = True, 0


class Prober:
    """Probes detached levels in one daemon thread, started on the first detach."""

    def __init__(self, levels: Sequence[Level], lock: threading.RLock) -> None:
        self._levels, self._lock = levels, lock
        self._cv = threading.Condition()  # its own lock: wake() is called under the store lock
        self._woken = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def wake(self) -> None:
        """A level was detached: (start and) wake the thread to schedule its probes."""
        with self._cv:
            if self._closed:
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tierkv-probe", daemon=True)
                self._thread.start()
            self._woken = True
            self._cv.notify()

    def close(self, timeout_s: float = 15.0) -> None:
        """Stop probing; waits for a probe in flight (bounded by the tier's own timeouts)."""
        with self._cv:
            self._closed = True
            self._cv.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._lock:
                now = time.monotonic()
                detached = [lv for lv in self._levels if not lv.available()]
                due = [lv for lv in detached if lv.breaker.next_probe <= now]
                wait = min((lv.breaker.next_probe - now for lv in detached), default=None)
            for lv in due:
                self._probe(lv)
            with self._cv:
                if self._closed:
                    return
                if not due and not self._woken:
                    self._cv.wait(wait)
                self._woken = False

    def _probe(self, lv: Level) -> None:
        try:
            lv.tier.probe()
        except Exception as e:  # noqa: BLE001 - any failure keeps the tier detached
            with self._lock:
                lv.probe_failed(e)
            return
        with self._lock:
            lv.attach()
