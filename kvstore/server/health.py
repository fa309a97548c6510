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
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2

from kvstore.store.tiered_store import TieredStore

TIER_SERVICE = "tierkv.tier."


class DaemonHealth(health.HealthServicer):
    def __init__(self, store: TieredStore) -> None:
        super().__init__()
        self._store = store

    def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext
              ) -> health_pb2.HealthCheckResponse:  # fmt: skip
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
