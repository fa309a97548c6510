"""BoundedCalls: a call's result or its exception, or DeadlineExceeded (a TimeoutError, so a tier
maps it to TierUnavailable) once the deadline passes, the stuck call left to finish on its worker."""

from __future__ import annotations

import threading

import pytest

from tiers.deadline import BoundedCalls, DeadlineExceeded


def test_result_exception_and_deadline() -> None:
    calls = BoundedCalls(1, "test-bounded")
    release = threading.Event()
    try:
        assert calls.call(lambda: 42, 10.0) == 42
        with pytest.raises(KeyError):
            calls.call(lambda: {}["missing"], 10.0)
        with pytest.raises(DeadlineExceeded) as caught:
            calls.call(lambda: release.wait(30), 0.2)
        assert isinstance(caught.value, TimeoutError)
        with pytest.raises(DeadlineExceeded):  # queued behind the stuck one: never runs
            calls.call(lambda: 1, 0.2)
        release.set()
        assert calls.call(lambda: 7, 10.0) == 7  # the worker is free again
    finally:
        release.set()
        calls.close()


def test_needs_a_worker() -> None:
    with pytest.raises(ValueError):
        BoundedCalls(0, "none")
