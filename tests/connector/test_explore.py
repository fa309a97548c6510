"""connector/explore.py: a bypassed tier is explored while unmeasured, then only after 32 bypasses
and 30 s without a measurement, whatever the request rate."""

from __future__ import annotations

from connector.explore import Explorer


def test_an_unmeasured_tier_is_always_explored() -> None:
    e = Explorer(every=4, after_s=10.0, clock=lambda: 0.0)
    assert all(e.wants("s3", 0) for _ in range(10))


def test_a_measured_tier_needs_both_the_bypasses_and_the_time() -> None:
    now = [0.0]
    e = Explorer(every=4, after_s=10.0, clock=lambda: now[0])
    assert [e.wants("s3", 1) for _ in range(100)] == [False] * 100  # the rate alone never explores
    now[0] = 10.0
    assert e.wants("s3", 1)  # 101 bypasses and 10 s
    assert [e.wants("s3", 1) for _ in range(3)] == [False] * 3  # both counts start again
    now[0] = 25.0
    assert [e.wants("s3", 1) for _ in range(4)] == [True, False, False, False]  # the 4th bypass, 15 s on


def test_a_measurement_starts_both_counts_again_per_tier() -> None:
    now = [0.0]
    e = Explorer(every=2, after_s=10.0, clock=lambda: now[0])
    e.wants("s3", 1)
    now[0] = 9.0
    assert not e.wants("redis", 1)  # another tier's counts are its own
    e.wants("s3", 2)  # a load measured s3 at 9 s: counted from here
    now[0] = 15.0
    assert not e.wants("s3", 2) and not e.wants("s3", 2)  # 3 bypasses, but 6 s
    now[0] = 19.0
    assert e.wants("s3", 2)
    assert e.wants("redis", 1)  # its 2nd bypass, 10 s after its first
