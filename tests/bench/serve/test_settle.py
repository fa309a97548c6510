"""bench.serve's settling between modes: it waits for idle CPUs and a drained offload queue, and
gives up at its bound (other engineers' load never falls on command)."""

from __future__ import annotations

from bench.serve.settle import busy_share, settle


class _Fake:
    """A clock and /proc/stat samples: ``busy`` is each window's busy share in turn."""

    def __init__(self, busy: list[float], queue: list[float] | None = None) -> None:
        self.t, self.busy, self.queue = 0.0, list(busy), list(queue or [])
        self.jiffies = [0, 0]
        self.pending = 0.0

    def clock(self) -> float:
        return self.t

    def sample(self) -> tuple[int, int]:
        return tuple(self.jiffies)  # type: ignore[return-value]

    def sleep(self, s: float) -> None:
        self.t += s
        b = self.busy.pop(0) if self.busy else 0.0
        self.jiffies = [self.jiffies[0] + int(b * 100), self.jiffies[1] + 100]

    def q(self) -> float:
        return self.queue.pop(0) if self.queue else 0.0


def test_busy_share() -> None:
    assert busy_share((10, 100), (60, 200)) == 0.5 and busy_share((1, 1), (1, 1)) == 0.0


def test_waits_until_the_cpus_are_idle() -> None:
    f = _Fake([0.9, 0.8, 0.2])
    s = settle(max_s=30, window_s=2, clock=f.clock, sample=f.sample, sleep=f.sleep)
    assert not s.timed_out and s.waited_s == 6 and s.busy == 0.2


def test_waits_for_the_daemon_queue_to_drain() -> None:
    f = _Fake([0.1] * 5, queue=[4e6, 1e6, 0.0])
    s = settle(max_s=30, window_s=2, queue=f.q, clock=f.clock, sample=f.sample, sleep=f.sleep)
    assert not s.timed_out and s.waited_s == 6 and s.queue == 0.0


def test_gives_up_at_its_bound_and_says_so() -> None:
    f = _Fake([1.0] * 100)
    s = settle(max_s=10, window_s=2, clock=f.clock, sample=f.sample, sleep=f.sleep)
    assert s.timed_out and s.waited_s == 10 and s.busy == 1.0
