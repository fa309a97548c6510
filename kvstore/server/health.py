"""gRPC health of the daemon, with one health service per tier.

Decision: a detached tier does not make the daemon unhealthy. The overall service ("") and the
KVStore service say SERVING while the daemon serves, even degraded: reads of a detached tier miss
(engines recompute) and its writes are skipped, and restarting the daemon would not bring the
tier's server back — it would only turn an outage of S3 into a crash loop of the cache. Where
the degradation shows: each tier has its own health service, ``tierkv.tier.<name>``, SERVING
while the tier is attached and NOT_SERVING while its circuit breaker has it detached; ``kvstore
health`` prints the detached tiers (and still exits 0), ``kvstore stats`` and /metrics
(``tierkv_tier_available``) show them with their last error.

The tier services answer Check from the store's own state (no copy to keep in sync); Watch is
not offered for them.

Health needs no token (probes must reach it), so it keeps no state for what a caller asks: a
service name is at most MAX_SERVICE_NAME bytes (INVALID_ARGUMENT past it); a Watch of a name this
daemon does not serve gets one SERVICE_UNKNOWN and ends (the base class kept a watcher and a dict
entry per name ever watched, for ever: the daemon registers no service after it starts); at most
``max_watches`` Watch streams are open at once (RESOURCE_EXHAUSTED past it).

A Watch holds no worker thread: it is served in gRPC's non-blocking mode (kept through our
interceptors), by our own code rather than the base class's. The base class sends each status
while holding its lock, and in non-blocking mode a send waits for gRPC's event thread; that thread,
closing another Watch at the same moment, waited for the same lock: a deadlock. Here a status is
sent with no shared lock held (one send at a time per stream, always the latest status).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from kvstore.store.tiered_store import TieredStore

TIER_SERVICE = "tierkv.tier."
MAX_SERVICE_NAME = 256  # bytes; gRPC service names are short dotted identifiers
_Status = health_pb2.HealthCheckResponse


def _check_name(name: str, context: grpc.ServicerContext) -> None:
    if len(name) > MAX_SERVICE_NAME or len(name.encode()) > MAX_SERVICE_NAME:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"health service name of {len(name.encode())} bytes "
                      f"(max {MAX_SERVICE_NAME})")


class _Watcher:
    """One open Watch stream: how to send to it, and the status it was sent last."""

    __slots__ = ("send", "lock", "sent")

    def __init__(self, send: Callable[[Any], object]) -> None:
        self.send, self.lock, self.sent = send, threading.Lock(), None


class DaemonHealth(health.HealthServicer):
    def __init__(self, store: TieredStore, max_watches: int = 16) -> None:
        super().__init__()
        self._store = store
        self.max_watches = max_watches
        self._lock_w = threading.Lock()  # guards the four below; never held while sending
        self._status: dict[str, Any] = {}  # the names this daemon serves (``set``) -> their status
        self._watchers: dict[str, set[_Watcher]] = {}  # open non-blocking Watch streams, by served name
        self._watching = 0  # open Watch streams, of either mode
        self._final = False  # shutting down: statuses no longer change

    def set(self, service: str, status: Any) -> None:
        super().set(service, status)  # what Check answers
        with self._lock_w:
            if self._final:
                return
            self._status[service] = status
            watchers = list(self._watchers.get(service, ()))
        for w in watchers:
            self._push(service, w)

    def enter_graceful_shutdown(self) -> None:
        with self._lock_w:
            names = list(self._status)
        for name in names:
            self.set(name, _Status.NOT_SERVING)
        with self._lock_w:
            self._final = True
        super().enter_graceful_shutdown()

    def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext,
              send_response_callback: Any = None) -> Any:  # fmt: skip
        name = request.service
        _check_name(name, context)
        with self._lock_w:
            known = name in self._status
            full = known and self._watching >= self.max_watches
            if known and not full:
                self._watching += 1
        if not known:  # one answer, then the call ends: nothing kept for this name
            unknown = _Status(status=_Status.SERVICE_UNKNOWN)
            if send_response_callback is None:
                return iter([unknown])
            send_response_callback(unknown)
            send_response_callback(None)
            return None
        if full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.max_watches} health Watch streams are open "
                          "(health_max_watches): use Check, or try again later")
        w = _Watcher(send_response_callback) if send_response_callback is not None else None
        if w is not None:
            with self._lock_w:
                self._watchers.setdefault(name, set()).add(w)
        if not context.add_callback(lambda: self._unwatch(name, w)):  # the call ended already
            self._unwatch(name, w)
            return None
        if w is None:  # blocking mode (not how the daemon serves it): the base class's stream
            return super().Watch(request, context)
        self._push(name, w)
        return None

    def _push(self, name: str, w: _Watcher) -> None:
        """Send ``w`` the current status of ``name`` unless it has it already; one send at a time
        per stream, so an older status never overtakes a newer one."""
        with w.lock:
            with self._lock_w:
                status = self._status.get(name)
            if status is not None and status != w.sent:
                w.sent = status
                w.send(_Status(status=status))

    def _unwatch(self, name: str, w: _Watcher | None) -> None:
        with self._lock_w:
            self._watching -= 1
            if w is not None:
                self._watchers.get(name, set()).discard(w)

    def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
              ) -> health_pb2.HealthCheckResponse:  # fmt: skip
        _check_name(request.service, context)
        if not request.service.startswith(TIER_SERVICE):
            resp = super().Check(request, context)
            if context.code() == grpc.StatusCode.NOT_FOUND:  # say which: the base class sets no message
                context.set_details(f"no health service {request.service!r}")
            return resp
        name = request.service[len(TIER_SERVICE) :]
        state = {lv.name: lv.available() for lv in self._store.levels}
        if name not in state:
            context.set_code(grpc.StatusCode.NOT_FOUND)
            context.set_details(f"no tier {name!r} in this daemon")
            return health_pb2.HealthCheckResponse()
        ok = state[name]
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING if ok
                                              else health_pb2.HealthCheckResponse.NOT_SERVING)  # fmt: skip
