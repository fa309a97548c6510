"""Kill a Redis Cluster master while a client writes and reads through a tier; count what it saw.

``drive_failover(cluster, tier, victim, heir, before, value_of)`` SIGKILLs master ``victim`` and
alternates a new write and a read of an old block (``before``, cycled) through ``tier`` until
``heir`` is master and a run of operations reading every old block once has all succeeded (redis-py
refreshes its slot map on the command after a refused one, so one failure after the promotion is
expected). Each read is checked against ``value_of(key)``: other bytes are ``wrong``, never allowed.
``recovery_s``: from the kill to the end of the last operation that failed. Used by
tests/tiers/test_redis_failover.py and ``python -m bench.cluster.probe``.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bench.cluster.redis_cluster import RedisCluster
from tiers.base import Tier
from tiers.errors import TierUnavailable


class FailoverStalled(RuntimeError):
    """The client did not recover before the deadline."""


@dataclass
class FailoverOutcome:
    recovery_s: float = 0.0
    outcomes: Counter[str] = field(default_factory=Counter)
    wrong: list[bytes] = field(default_factory=list)  # keys read back with other bytes
    during: list[bytes] = field(default_factory=list)  # keys whose write was acknowledged mid-failover

    @property
    def unavailable(self) -> int:
        return self.outcomes["put unavailable"] + self.outcomes["read unavailable"]


def drive_failover(cluster: RedisCluster, tier: Tier, victim: int, heir: int, before: Sequence[bytes],
                   value_of: Callable[[bytes], bytes], deadline_s: float = 30.0, tag: str = "during",
                   pause_s: float = 0.05) -> FailoverOutcome:
    out = FailoverOutcome()
    killed_at = time.monotonic()
    cluster.kill(victim)
    promoted, clean, i = False, 0, 0
    while not (promoted and clean >= len(before)):
        if time.monotonic() - killed_at > deadline_s:
            raise FailoverStalled(f"no recovery {deadline_s}s after the kill: {dict(out.outcomes)}")
        key, old = f"{tag}-{i}".encode(), before[i % len(before)]
        i += 1
        ok = True
        try:
            tier.put(key, value_of(key))
            out.during.append(key)
        except TierUnavailable:
            out.outcomes["put unavailable"] += 1
            ok = False
        try:
            got = tier.get(old)
            out.outcomes["read hit" if got is not None else "read miss"] += 1
            if got is not None and got != value_of(old):
                out.wrong.append(old)
            ok = ok and got is not None
        except TierUnavailable:
            out.outcomes["read unavailable"] += 1
            ok = False
        if not ok:
            out.recovery_s = time.monotonic() - killed_at
        promoted = promoted or cluster.roles()[heir] == "master"
        clean = clean + 1 if promoted and ok else 0
        time.sleep(pause_s)
    return out
