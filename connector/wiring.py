"""The composition root: builds the tierkv connector and CacheBlend onto an engine, in one order.

``order_hooks`` is the one place that decides the order of the scheduler's admission hooks: first
the exact prefix from the kvstore daemon (the connector), then CacheBlend on what remains, so a
blend prompt whose head is in the daemon loads it exactly and blends only the rest. Every attach
and detach goes through it, whatever order they are called in.

``kvengine`` reaches these functions by name through engine/plugins.py ("tierkv", "cacheblend"):
engine/ never imports connector/ or kvstore/.
"""

from __future__ import annotations

import logging

from connector.blend import BlendConfig, BlendHook, BlendUnsupportedError
from connector.blend.chunk_cache import ChunkStore, InProcessChunkStore
from connector.blend.daemon_store import DaemonChunkStore
from connector.blend.frontend import BlendFrontend
from connector.blend.hook import ENV as BLEND_ENV
from connector.blend.metrics import BlendCollector
from connector.config import ENV as CONNECTOR_ENV
from connector.config import ConnectorConfig
from connector.connector import KVConnector
from connector.cost_model import PrefillModel
from kvstore.client import KVStoreClient

log = logging.getLogger(__name__)


def order_hooks(engine) -> None:
    """Exact before approximate: the daemon's prefix first, then CacheBlend on what remains."""
    engine.hooks = [h for h in (engine.connector, engine.blend) if h is not None]


def attach_tierkv(engine, address: str | ConnectorConfig, prefill: PrefillModel | None = None,
                  **overrides: object) -> KVConnector:
    """Connect ``engine`` to a kvstore daemon: admission hook, evict listener, /metrics."""
    cfg = address if isinstance(address, ConnectorConfig) else ConnectorConfig.from_env(address, **overrides)
    conn = KVConnector(engine, cfg, prefill=prefill)
    engine.connector = conn
    engine.evict_listeners.append(conn.on_evict)
    engine.step_listeners.append(conn.on_step)
    engine.metric_collectors.extend(conn.metrics.collectors())
    order_hooks(engine)
    return conn


def detach_tierkv(engine) -> None:
    conn = engine.connector
    if conn is None:
        return
    engine.connector = None
    order_hooks(engine)
    if conn.on_evict in engine.evict_listeners:
        engine.evict_listeners.remove(conn.on_evict)
    if conn.on_step in engine.step_listeners:
        engine.step_listeners.remove(conn.on_step)
    conn.close()


def chunk_store(engine, config: BlendConfig) -> ChunkStore:
    """The daemon's store (an in-process LRU in front) when a connector is attached, so replicas
    share documents' KV; else the in-process LRU alone."""
    local = InProcessChunkStore(config.chunk_store_bytes)
    conn = engine.connector
    if not isinstance(conn, KVConnector):
        return local
    client = KVStoreClient(conn.cfg.address, deadline_s=conn.cfg.offload_deadline_s, use_shm=conn.cfg.use_shm)
    return DaemonChunkStore(client, local=local)


def attach_cacheblend(engine, config: BlendConfig | None = None, store: ChunkStore | None = None) -> BlendHook:
    """Add the CacheBlend hook (raises BlendUnsupportedError if the model fails the RoPE self-check)."""
    config = config or BlendConfig()
    hook = BlendHook(engine, config, store if store is not None else chunk_store(engine, config))
    engine.blend = hook
    engine.metric_collectors.append(BlendCollector(hook.metrics))
    order_hooks(engine)
    return hook


def attach_blend_frontend(engine, config: BlendConfig | None = None) -> BlendFrontend | None:
    """CacheBlend for the server: the hook plus the request builders; None if the model is unsupported.
    Without ``config`` it comes from ``TIERKV_BLEND_*`` (e.g. the quality gate's TIERKV_BLEND_GATE_FRACTION)."""
    config = config or BlendConfig.from_env()
    try:
        hook = attach_cacheblend(engine, config)
    except BlendUnsupportedError:
        log.error("CacheBlend self-check FAILED for this model: requests with `documents` will be refused",
                  exc_info=True)
        return None
    return BlendFrontend(engine.tokenizer, hook)


# -- --check-config: what each plug-in would build from the environment, validated, nothing started --
def check_tierkv_config(address: str) -> None:
    ConnectorConfig.from_env(address)  # TIERKV_CONNECTOR_*: raises ValueError with the field


def check_blend_config() -> None:
    BlendConfig.from_env()  # TIERKV_BLEND_*: raises ConfigError with the field


attach_tierkv.check_config = check_tierkv_config  # type: ignore[attr-defined]
attach_blend_frontend.check_config = check_blend_config  # type: ignore[attr-defined]
# what each plug-in reads from the environment: kvengine's unknown-variable warnings (engine/plugins.py)
attach_tierkv.declares_env = CONNECTOR_ENV  # type: ignore[attr-defined]
attach_blend_frontend.declares_env = BLEND_ENV  # type: ignore[attr-defined]
