"""gRPC errors are typed at the client boundary, before any retry decision (as redis-py does):
a deadline is KVStoreTimeout, an unreachable daemon KVStoreUnavailable, both under the one root
KVStoreError, both retried; a refusal is never retried."""

from __future__ import annotations

import pytest

from bench.servers import free_port
from kvstore.client.retry import ExponentialBackoff, Retry
from kvstore.errors import InvalidRequest, KVStoreError, KVStoreTimeout, KVStoreUnavailable
from tests.fixtures_kvstore import Gate, block, connect, fetch_one, inprocess_daemon

FAST = Retry(attempts=3, backoff=ExponentialBackoff(base_s=0.01, cap_s=0.01, jitter=False))


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "stream"])
def test_deadline_is_a_retried_timeout(use_shm: bool) -> None:
    with inprocess_daemon() as d, connect(d, deadline_s=10, retry=FAST, use_shm=use_shm) as c:
        k, v = block("held", 2.0)
        c.put(k, v)
        gate = Gate(k)
        d.store.on_read = gate
        c.deadline_s = 0.3
        try:
            with pytest.raises(KVStoreTimeout) as ei:
                fetch_one(c, k)
        finally:
            gate.release.set()
        assert isinstance(ei.value, KVStoreError) and not isinstance(ei.value, KVStoreUnavailable)
        assert d.store.reads[k] == FAST.attempts  # typed first, then retried as a timeout
        d.store.on_read = None
        c.deadline_s = 10
        assert fetch_one(c, k) == v


def test_unreachable_is_unavailable() -> None:
    with connect(f"127.0.0.1:{free_port()}", deadline_s=5, retry=FAST) as c:
        with pytest.raises(KVStoreUnavailable) as ei:
            c.lookup([b"k" * 16])
    assert isinstance(ei.value, KVStoreError)


def test_refusal_is_typed_and_not_retried() -> None:
    with inprocess_daemon() as d, connect(d, retry=FAST) as c:
        with pytest.raises(InvalidRequest, match="length 0"):
            c.lookup([b""])


def test_retry_only_retries_the_given_types() -> None:
    calls: list[int] = []

    def fail(exc: Exception) -> None:
        calls.append(1)
        raise exc

    with pytest.raises(KVStoreTimeout):
        FAST.call(lambda: fail(KVStoreTimeout("slow")), retry_on=(KVStoreTimeout,))
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(InvalidRequest):
        FAST.call(lambda: fail(InvalidRequest("bad")), retry_on=(KVStoreTimeout, KVStoreUnavailable))
    assert len(calls) == 1
