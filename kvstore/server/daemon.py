"""The daemon process: gRPC server + health + metrics around one TieredStore.

A remote tier that is down at start does not stop the daemon: it starts degraded, with that tier
detached, and attaches it once it answers (kvstore/store/breaker.py; health: kvstore/server/health.py).

Limits (each a StoreConfig field): ``max_concurrent_rpcs`` calls at once (past it gRPC refuses
RESOURCE_EXHAUSTED), keepalive and idle limits on connections (``grpc_options``), Put streams
bounded in number and time (kvstore/server/put_streams.py), keys per call, health Watch streams
(kvstore/server/health.py), and timeouts on the metrics port (kvstore/server/metrics.py).

SIGHUP reloads the credentials file (kvstore/server/credentials.py), if there is one.

Shutdown order on SIGTERM/SIGINT matters: mark health NOT_SERVING (load balancers stop
routing), stop accepting new calls while in-flight ones get ``grace_s`` to finish, then
``store.close()`` waits for queued spills to land on disk before tiers are closed — a block
acknowledged to a client is on its way down and not dropped by the shutdown.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.config.store_config import StoreConfig
from kvstore.ops.dashboard import Dashboard
from kvstore.ops.stats_log import StatsLogger
from kvstore.ops.trace_curves import LatestCurves
from kvstore.proto import kvstore_pb2, kvstore_pb2_grpc
from kvstore.server import auth, stream_tls
from kvstore.server.health import DaemonHealth
from kvstore.server.malformed_requests import MalformedRequests
from kvstore.server.metrics import StoreMetrics
from kvstore.server.servicer import KVStoreServicer
from kvstore.server.shm_listener import ShmListener
from kvstore.server.shm_sessions import ShmSessions
from kvstore.server.stream_server import StreamServer
from kvstore.store.tier_factory import build_store
from tiers.errors import ConfigError

log = logging.getLogger(__name__)
SERVICE_NAME = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name


def grpc_options(cfg: StoreConfig) -> list[tuple[str, int]]:
    """The server's channel options: message sizes, and the connection limits. A connection is
    pinged every ``keepalive_time_s`` and dropped, with its calls, when the ping goes unanswered
    for ``keepalive_timeout_s`` (a client that died or vanished holds no call for ever); one that
    ran no call for ``max_connection_idle_s`` is closed (clients reconnect on their next call);
    a client pinging more often than ``min_client_ping_interval_s`` is sent away after two such
    pings (gRPC's ping strikes), so pings cannot be used to keep the server busy."""
    def ms(seconds: float) -> int:
        return int(seconds * 1000)

    return [
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", ms(cfg.keepalive_time_s)),
        ("grpc.keepalive_timeout_ms", ms(cfg.keepalive_timeout_s)),
        ("grpc.http2.ping_timeout_ms", ms(cfg.keepalive_timeout_s)),  # what closes the connection (default 60 s)
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.max_connection_idle_ms", ms(cfg.max_connection_idle_s)),
        ("grpc.http2.min_ping_interval_without_data_ms", ms(cfg.min_client_ping_interval_s)),
        ("grpc.http2.max_ping_strikes", 2),
    ]


class Daemon:
    """Everything one ``kvstore serve`` runs; ``start``/``stop`` for tests and embedding."""

    def __init__(self, cfg: StoreConfig) -> None:
        self.cfg = cfg
        self.metrics = StoreMetrics()
        self.store = build_store(cfg, observer=self.metrics)
        top = self.store.arena()
        if top is not None:
            log.info("cpu tier: %s arena, %s pages", "shared (memfd)" if top.share() else "private", top.page_kind)
        self.dashboard = Dashboard(self.store)  # /dashboard on the metrics port; set .curves to show a curve
        self.metrics.routes.update(self.dashboard.routes())
        self.sessions = ShmSessions(max_bytes=cfg.shm_max_bytes)
        try:
            self.access, creds = auth.server_access(cfg), auth.server_credentials(cfg)
        except BaseException:
            self.store.close(flush=False)
            raise
        self.metrics.bind(self.store, self.access.display)  # tenants on /metrics by name, as in Stats
        # under TLS the raw channel is TLS too, with the same certificate (kvstore/server/stream_tls.py)
        try:
            self.streams = (StreamServer(self.store, cfg.listen.rpartition(":")[0], cfg.stream_port,
                                         max_conns=cfg.stream_max_conns, max_request_bytes=cfg.max_message_bytes,
                                         max_keys=cfg.max_keys_per_call, tls=stream_tls.server_context_of(cfg))
                            if cfg.stream else None)  # fmt: skip
        except BaseException:
            self.store.close(flush=False)
            raise
        # SERVING even with a tier detached; Watch bounded (see kvstore/server/health.py)
        self.health = DaemonHealth(self.store, max_watches=cfg.health_max_watches)
        on = self.access.table is not None
        checks = [auth.AuthInterceptor(self.access, self.metrics.auth_refused)] if on else []
        checks.append(MalformedRequests())  # inside the auth check: bytes that are no message -> INVALID_ARGUMENT
        self.server = grpc.server(ThreadPoolExecutor(max_workers=cfg.workers), options=grpc_options(cfg),
                                  interceptors=checks, maximum_concurrent_rpcs=cfg.max_concurrent_rpcs)
        self.servicer = servicer = KVStoreServicer(self.store, cfg, self.sessions, self.streams, access=self.access)
        self.dashboard.curves = LatestCurves()  # the last trace's curve on /dashboard
        servicer.on_trace_written = self.dashboard.curves.update
        kvstore_pb2_grpc.add_KVStoreServicer_to_server(servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if not on and not cfg.listen.startswith(("127.", "localhost:", "[::1]:")):
            log.warning("--no-auth on %s: any caller that reaches this port reads and writes the cache", cfg.listen)
        if creds is None:
            self.port = self.server.add_insecure_port(cfg.listen)
        else:
            self.port = self.server.add_secure_port(cfg.listen, creds)
        if self.port == 0:
            if self.streams is not None:
                self.streams.close()
            self.store.close(flush=False)
            raise ConfigError(f"cannot listen on {cfg.listen}")
        self.shm_listener = self._shm_listener(cfg, servicer)
        self.metrics_port = 0
        self.stats_log = StatsLogger(self.store.stats, cfg.stats_interval_s)
        self._stopped = threading.Event()

    def _shm_listener(self, cfg: StoreConfig, servicer: KVStoreServicer) -> ShmListener | None:
        """The unix socket clients hand their segments over on (kvstore/server/shm_listener.py).
        One configured that cannot be had stops the daemon; the default one only turns shared
        memory off (logged: clients stream)."""
        if not cfg.shm:
            return None
        path = cfg.shm_socket or str(auth.runtime_dir() / f"shm-{self.port}.sock")
        try:
            return ShmListener(self.sessions, path, servicer.arena_share)
        except ConfigError as e:
            if cfg.shm_socket:
                if self.streams is not None:
                    self.streams.close()
                self.store.close(flush=False)
                raise
            log.warning("%s: shared memory off, clients stream", e)
            return None

    @property
    def address(self) -> str:
        return f"{self.cfg.listen.rpartition(':')[0]}:{self.port}"

    def start(self) -> None:
        self.server.start()
        if self.streams is not None:
            self.streams.start()
        self.sessions.start()  # expires leases
        if self.shm_listener is not None:
            self.shm_listener.start()  # ... and this drops the session of a client whose connection closed
        if self.cfg.metrics_listen:
            host, _, port = self.cfg.metrics_listen.rpartition(":")
            self.metrics_port = self.metrics.serve(int(port), addr=host.strip("[]"), timeout_s=self.cfg.metrics_timeout_s)
        elif self.cfg.metrics_port:
            self.metrics_port = self.metrics.serve(self.cfg.metrics_port, timeout_s=self.cfg.metrics_timeout_s)
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.stats_log.start()

    def reload_credentials(self) -> bool:
        """Read the credentials file again (SIGHUP) and switch to it whole; a bad file is logged
        and the credentials in force stay. Raw-channel connections follow at their next request."""
        if not self.cfg.credentials_file or self.access.table is None:
            log.warning("SIGHUP: no credentials file to reload")
            return False
        try:
            table = self.access.reload(self.cfg.credentials_file)
        except ConfigError as e:
            log.error("credentials not reloaded, the previous ones stay: %s", e)
            return False
        log.info("credentials reloaded: %d credentials, tenants %s", len(table), ", ".join(table.tenants) or "none")
        return True

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.stats_log.close()
        self.health.enter_graceful_shutdown()
        self.server.stop(self.cfg.grace_s).wait()
        self.servicer.close()
        if self.streams is not None:
            self.streams.close()
        self.store.close(flush=True)  # in-flight spills land before tiers close
        if self.shm_listener is not None:
            self.shm_listener.close()
        self.sessions.close()
        self.metrics.close()


def serve(cfg: StoreConfig) -> int:
    """Run the daemon until SIGTERM/SIGINT; prints its address on stdout once serving."""
    daemon = Daemon(cfg)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        log.info("signal %d: shutting down", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    reload = threading.Event()
    signal.signal(signal.SIGHUP, lambda signum, frame: reload.set())
    daemon.start()
    host = cfg.metrics_listen.rpartition(":")[0] if cfg.metrics_listen else "127.0.0.1"
    extra = f" metrics {host}:{daemon.metrics_port}" if daemon.metrics_port else ""
    print(f"kvstore listening on {daemon.address}{extra}", flush=True)
    while not stop.wait(1.0):
        if reload.is_set():  # read here, not in the handler: a file read is no work for a signal handler
            reload.clear()
            daemon.reload_credentials()
    daemon.stop()
    print("kvstore stopped", flush=True)
    sys.stdout.flush()
    return 0
