"""``attach_kvstore(engine, address)``: connect an engine to a kvstore daemon.

Called by ``kvengine serve --kvstore ADDR`` (engine/cli.py). It builds the connector (which
calibrates the prefill model and probes the daemon), registers it as the scheduler's admission
hook and the radix cache's evict listener, and adds its metrics to the engine's /metrics.
"""

from __future__ import annotations

from connector.config import ConnectorConfig
from connector.connector import KVConnector
from connector.cost_model import PrefillModel


def attach_kvstore(engine, address: str | ConnectorConfig, prefill: PrefillModel | None = None,
                   **overrides: object) -> KVConnector:
    cfg = address if isinstance(address, ConnectorConfig) else ConnectorConfig.from_env(address, **overrides)
    conn = KVConnector(engine, cfg, prefill=prefill)
    engine.scheduler.hooks.insert(0, conn)  # before CacheBlend: it sees the loaded prefix
    engine.evict_listeners.append(conn.on_evict)
    collectors = getattr(engine, "metric_collectors", None)
    if collectors is not None:
        collectors.extend(conn.metrics.collectors())
    engine.connector = conn
    return conn


def detach_kvstore(engine) -> None:
    conn = getattr(engine, "connector", None)
    if conn is None:
        return
    if conn in engine.scheduler.hooks:
        engine.scheduler.hooks.remove(conn)
    if conn.on_evict in engine.evict_listeners:
        engine.evict_listeners.remove(conn.on_evict)
    conn.close()
    engine.connector = None
