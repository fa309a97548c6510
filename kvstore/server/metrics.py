"""Prometheus metrics of one TieredStore, on a registry of its own (no globals), and the HTTP port.

Counters and usage are kept by the store itself (one source of truth, also used by the Stats
RPC); a custom collector turns ``store.stats()`` into metric families at scrape time. Only the
latency histograms and the count of corrupt blocks (by tier and reason) are observed as events
happen, through the store's Observer hook.

The HTTP port serves /metrics, and any extra read-only pages registered in ``routes`` before
``serve`` (the daemon adds /dashboard and /dashboard.json, kvstore/ops/dashboard.py).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import fields
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from kvstore.store.results import TierCounters
from kvstore.store.tiered_store import TieredStore

_LAT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
#: tenants labelled per tier on /metrics (the largest by bytes); the rest are summed under tenant="_other",
#: so a daemon with thousands of tenants exports at most this many series per tier and metric
METRIC_TENANTS = 16


def _as_is(name: str) -> str:
    return name


class _StoreCollector(Collector):
    def __init__(self, store: TieredStore, display: Callable[[str], str] = _as_is) -> None:
        self._store = store
        self._display = display  # a tenant row's name as the operator knows it (see StoreMetrics.bind)

    def collect(self) -> Iterator[Metric]:
        st = self._store.stats(tenant_rows=METRIC_TENANTS)
        gauges = {
            "used_bytes": GaugeMetricFamily("tierkv_tier_used_bytes", "Bytes the store tracks in the tier (shared tier: its own writes)", labels=["tier"]),
            "capacity_bytes": GaugeMetricFamily("tierkv_tier_capacity_bytes", "Configured bytes", labels=["tier"]),
            "blocks": GaugeMetricFamily("tierkv_tier_blocks", "Blocks held by the tier", labels=["tier"]),
            "available": GaugeMetricFamily("tierkv_tier_available", "1 while the tier is attached, 0 while its circuit "
                                           "breaker has it detached (skipped, probed in the background)", labels=["tier"]),
        }
        counters = {
            f.name: CounterMetricFamily(f"tierkv_tier_{f.name}", f.metadata["doc"], labels=["tier"])
            for f in fields(TierCounters)
        }
        for t in st.tiers:
            for name, fam in gauges.items():
                fam.add_metric([t.name], float(getattr(t, name)))
            for name, fam in counters.items():
                fam.add_metric([t.name], float(getattr(t, name)))
        yield from gauges.values()
        yield from counters.values()
        t_bytes = GaugeMetricFamily("tierkv_tenant_used_bytes", "Bytes of one tenant in the tier (tenant: a "
                                    "configured tenant's name, else the 12-hex tag its keys carry, default, shared; "
                                    f"the tenants past the largest {METRIC_TENANTS} per tier summed as _other)",
                                    labels=["tier", "tenant"])
        t_blocks = GaugeMetricFamily("tierkv_tenant_blocks", "Blocks of one tenant in the tier (as "
                                     "tierkv_tenant_used_bytes)", labels=["tier", "tenant"])
        show = self._display
        for row in st.tenants:  # one name per tag (configured tags never collide): the cardinality stays bounded
            t_bytes.add_metric([row.tier, show(row.tenant)], float(row.used_bytes))
            t_blocks.add_metric([row.tier, show(row.tenant)], float(row.blocks))
        yield t_bytes
        yield t_blocks
        top = self._store.arena()
        if top is not None:
            arena = GaugeMetricFamily("tierkv_cpu_arena_info", "The cpu tier's arena: 1, labelled with its pages "
                                      "(hugetlb, thp, 4KiB, pinned) and whether clients may map it",
                                      labels=["pages", "shared"])
            arena.add_metric([top.page_kind, str(top.share() is not None).lower()], 1.0)
            yield arena
        pend = GaugeMetricFamily("tierkv_spill_queue_bytes", "Bytes waiting to spill to a lower tier")
        pend.add_metric([], float(st.pending_bytes))
        yield pend
        parked = GaugeMetricFamily("tierkv_replay_parked_bytes", "Bytes of blocks evicted while the shared tiers "
                                   "that skipped them were detached, kept in memory for their replay "
                                   "(at most replay_park_bytes)")
        parked.add_metric([], float(st.parked_bytes))
        yield parked
        dropped = CounterMetricFamily("tierkv_spill_queue_timeouts", "Blocks a call could not queue to spill "
                                      "within spill_put_timeout_s (the queue stayed full): not stored below")
        dropped.add_metric([], float(st.spill_timeouts))
        yield dropped
        lk = self._store.lookup_counts()
        keys = CounterMetricFamily("tierkv_lookup_keys", "Keys of read lookups: found (result hit), absent and "
                                   "evicted lately by that tier (result evicted), or absent (result absent)",
                                   labels=["result", "tier"])
        for tier, n in lk.hits.items():
            keys.add_metric(["hit", tier], float(n))
        for tier, n in lk.evicted.items():
            keys.add_metric(["evicted", tier], float(n))
        keys.add_metric(["absent", ""], float(lk.absent))
        yield keys


class _QuietHandler(WSGIRequestHandler):
    timeout = 10.0  # seconds a socket read or write may wait (StoreMetrics.serve sets its own)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    def handle(self) -> None:
        try:
            super().handle()
        except (TimeoutError, ConnectionError):  # a client that went silent or away: its thread ends here
            self.close_connection = True


def _wsgi(registry: CollectorRegistry, routes: dict[str, Callable[[], tuple[str, bytes]]]) -> Callable:
    metrics = make_wsgi_app(registry)

    def app(environ: dict, start_response: Callable) -> list[bytes]:
        route = routes.get(environ.get("PATH_INFO", ""))
        if route is None:
            return metrics(environ, start_response)
        if environ.get("REQUEST_METHOD") not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD"), ("Content-Length", "0")])
            return [b""]
        ctype, body = route()
        start_response("200 OK", [("Content-Type", ctype), ("Content-Length", str(len(body))),
                                  ("Cache-Control", "no-store")])
        return [body]

    return app


class StoreMetrics:
    """Observer for the store's reads/writes + the registry served on /metrics."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._read = Histogram(
            "tierkv_tier_read_seconds", "Latency of one block read from a tier", ["tier"],
            registry=self.registry, buckets=_LAT_BUCKETS,
        )  # fmt: skip
        self._read_by_tier: dict[str, Any] = {}
        self._write = Histogram(
            "tierkv_tier_write_seconds", "Latency of one block write to a tier", ["tier"],
            registry=self.registry, buckets=_LAT_BUCKETS,
        )  # fmt: skip
        self._corrupt = Counter(
            "tierkv_tier_corrupt_blocks", "Blocks read from a tier that failed verification and were deleted "
            "from it (reason: checksum, format, key; in redis and s3 also unsigned, unknown_secret, mac: the MAC), "
            "or were refused without being read whole (size: over the largest block)", ["tier", "reason"],
            registry=self.registry,
        )  # fmt: skip
        self._refused = Counter(
            "tierkv_auth_refused", "gRPC calls refused UNAUTHENTICATED, never served (reason: missing, wrong "
            "token)", ["reason"], registry=self.registry,
        )  # fmt: skip
        self._http: Any = None
        self.routes: dict[str, Callable[[], tuple[str, bytes]]] = {}  # path -> () -> (content type, body)

    def read(self, tier: str, nbytes: int, seconds: float) -> None:
        # the labelled child, looked up once per tier: ``labels()`` costs more than the observation
        # itself, and a Get of a 2k-token prompt observes 128 reads
        child = self._read_by_tier.get(tier)
        if child is None:
            child = self._read_by_tier[tier] = self._read.labels(tier)
        child.observe(seconds)

    def write(self, tier: str, nbytes: int, seconds: float) -> None:
        self._write.labels(tier).observe(seconds)

    def corrupt(self, tier: str, reason: str) -> None:
        self._corrupt.labels(tier, reason).inc()

    def auth_refused(self, reason: str) -> None:
        self._refused.labels(reason).inc()

    def bind(self, store: TieredStore, display: Callable[[str], str] = _as_is) -> None:
        """Expose the store's usage and counters (call once, after the store is built).

        ``display`` names a tenant row as the operator knows it: the daemon passes its credentials'
        ``Access.display`` (a configured tenant's name for its tag, asked at each scrape so a
        reloaded credentials file applies), the same mapping its Stats RPC uses; tags of no
        configured tenant, ``default``, ``shared`` and ``_other`` stay as they are."""
        self.registry.register(_StoreCollector(store, display))

    def serve(self, port: int, addr: str = "127.0.0.1", timeout_s: float = 10.0) -> int:
        """Serve /metrics (and ``routes``) over HTTP on ``addr:port`` in a daemon thread; returns the port.

        Each connection has its own thread; ``timeout_s`` bounds every read and write on it, so a
        client that connects and sends nothing (or stops reading) holds a thread that long at most."""
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]

        class Server(ThreadingWSGIServer):  # the address family of this address (IPv6 too), for this server only
            address_family = family

        class Handler(_QuietHandler):
            timeout = timeout_s

        self._http = make_server(sockaddr[0], port, _wsgi(self.registry, dict(self.routes)), Server,
                                 handler_class=Handler)
        threading.Thread(target=self._http.serve_forever, name="tierkv-http", daemon=True).start()
        return int(self._http.server_port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            threading.Thread(target=self._http.server_close, daemon=True).start()
            self._http = None
