"""Health is served without a token, so it keeps nothing per caller: names bounded, no state for
names it does not serve, Watch streams bounded and holding no worker thread.
"""

from __future__ import annotations

import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.server.daemon import SERVICE_NAME
from tests.fixtures_kvstore import served
from tests.kvstore.faults_support import wait_for
from tests.kvstore.limits_support import WAIT_S, lookup, settings

pytestmark = pytest.mark.timeout(180)


def test_watching_unknown_names_keeps_nothing(tmp_path: Path) -> None:
    unknown = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
    with served(tmp_path, "--no-auth") as d, grpc.insecure_channel(d.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)

        def watch(name: str) -> list[int]:
            return [r.status for r in stub.Watch(health_pb2.HealthCheckRequest(service=name), timeout=WAIT_S)]

        for i in range(1000):  # each: one answer, and the call ends (it used to stay open, kept for ever)
            assert watch(f"no.such.service.{i}") == [unknown]
        assert watch("tierkv.tier.cpu") == [unknown]  # tiers answer Check only
        assert set(d.health._watchers) <= {"", SERVICE_NAME}  # no state for a name it does not serve
        assert not d.health._send_response_callbacks  # nor in the base class's per-name map


def test_health_service_names_are_bounded(tmp_path: Path) -> None:
    with served(tmp_path, "--no-auth") as d, grpc.insecure_channel(d.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("x" * 257, "y" * (4 << 20)):
            req = health_pb2.HealthCheckRequest(service=name)
            for call in (lambda r=req: stub.Check(r, timeout=WAIT_S), lambda r=req: list(stub.Watch(r, timeout=WAIT_S))):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert e.value.details() == f"health service name of {len(name)} bytes (max 256)"
        with pytest.raises(grpc.RpcError) as e:  # at the bound: looked up, and simply not served
            stub.Check(health_pb2.HealthCheckRequest(service="x" * 256), timeout=WAIT_S)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_watch_streams_are_capped(tmp_path: Path) -> None:
    with served(tmp_path, "--no-auth", env=settings(health_max_watches=2)) as d, grpc.insecure_channel(d.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        open_ = [stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=WAIT_S) for _ in range(2)]
        assert [next(s).status for s in open_] == [health_pb2.HealthCheckResponse.SERVING] * 2
        with pytest.raises(grpc.RpcError) as e:
            next(stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=WAIT_S))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        open_[0].cancel()
        wait_for(lambda: d.health._watching == 1, "the cancelled Watch to be counted out")
        again = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=WAIT_S)
        assert next(again).status == health_pb2.HealthCheckResponse.SERVING
        for s in (open_[1], again):
            s.cancel()


def test_open_watch_streams_hold_no_worker(tmp_path: Path) -> None:
    """Four Watch streams on a daemon of two workers: Lookups are still answered."""
    with served(tmp_path, "--no-auth", env=settings(workers=2, health_max_watches=4)) as d, \
            grpc.insecure_channel(d.address) as ch:  # fmt: skip
        stub = health_pb2_grpc.HealthStub(ch)
        watches = [stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=WAIT_S) for _ in range(4)]
        assert [next(s).status for s in watches] == [health_pb2.HealthCheckResponse.SERVING] * 4
        assert lookup(d.address, [b"k"]).prefix_len == 0
        for s in watches:
            s.cancel()


def test_watches_opening_and_closing_together_never_deadlock_and_hear_of_changes(tmp_path: Path) -> None:
    """The base class sent a status while holding its lock, and a non-blocking send waits for
    gRPC's event thread, which (closing another Watch) waited for that lock: Watch streams opened
    while others closed hung the daemon's health for good."""
    with served(tmp_path, "--no-auth", env=settings(health_max_watches=64)) as d, \
            grpc.insecure_channel(d.address) as ch:  # fmt: skip
        stub = health_pb2_grpc.HealthStub(ch)

        def churn() -> None:
            for _ in range(25):
                s = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=WAIT_S)
                next(s)
                s.cancel()

        threads = [threading.Thread(target=churn) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(4 * WAIT_S)
        assert not any(t.is_alive() for t in threads), "Watch streams hung"
        s = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=WAIT_S)
        assert next(s).status == health_pb2.HealthCheckResponse.SERVING
        d.health.enter_graceful_shutdown()  # what SIGTERM does first
        assert next(s).status == health_pb2.HealthCheckResponse.NOT_SERVING
        s.cancel()
        wait_for(lambda: d.health._watching == 0, "every Watch to be counted out")
