"""The composition root: builds the tierkv connector and CacheBlend onto an engine, in one order.

``order_hooks`` is the one place that decides the order of the engine's admission hooks: first
the exact prefix from the kvstore daemon (the connector, a loading hook), then CacheBlend on what
remains, so a blend prompt whose head is in the daemon loads it exactly and blends only the rest.
Every attach and detach goes through it, whatever order they are called in. The engine names no
plug-in: it has a list of hooks, and ``connector_of`` / ``blend_of`` find ours in it.

``kvengine`` reaches these functions by name through engine/plugins.py ("tierkv", "cacheblend"):
engine/ never imports connector/ or kvstore/.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

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
from engine.hooks import LoadingHook
from engine.tenancy import served_tenants
from kvstore.client.client import KVStoreClient

log = logging.getLogger(__name__)


def connector_of(engine) -> KVConnector | None:
    """The tierkv connector attached to ``engine`` (None: none)."""
    return next((h for h in engine.hooks if isinstance(h, KVConnector)), None)


def blend_of(engine) -> BlendHook | None:
    """The CacheBlend hook attached to ``engine`` (None: none)."""
    return next((h for h in engine.hooks if isinstance(h, BlendHook)), None)


def order_hooks(hooks: Iterable[object]) -> list[object]:
    """Exact before approximate: loading hooks (the daemon's exact prefix) first, then the plain ones
    (CacheBlend on what remains), each kind in the order given."""
    return sorted(hooks, key=lambda h: not isinstance(h, LoadingHook))


def _install(engine, hook: object | None = None, remove: object | None = None) -> None:
    """Set the engine's hooks, with ``hook`` replacing any of its kind and ``remove`` taken out."""
    kept = [h for h in engine.hooks if h is not remove and (hook is None or type(h) is not type(hook))]
    engine.hooks = order_hooks([*kept, hook] if hook is not None else kept)


def install_hook(engine, hook: object) -> None:
    """Add a hook of one's own (a test's, an embedder's) in its place in the order."""
    _install(engine, hook)


def attach_tierkv(engine, address: str | ConnectorConfig, prefill: PrefillModel | None = None,
                  **overrides: object) -> KVConnector:
    """Connect ``engine`` to a kvstore daemon: admission hook, evict listener, /metrics. The start-up
    probe writes in a tenant the engine serves (its ``--tenant`` or an API key's), which the engine's
    daemon credential lists, unless told otherwise."""
    if not isinstance(address, ConnectorConfig):
        cfg_e = getattr(engine, "cfg", None)
        served = served_tenants(getattr(cfg_e, "tenant", ""), getattr(cfg_e, "api_keys_file", ""))
        if served and "probe_tenant" not in overrides and "probe_tenant" not in CONNECTOR_ENV.overrides():
            overrides["probe_tenant"] = served[0]
    cfg = address if isinstance(address, ConnectorConfig) else ConnectorConfig.from_env(address, **overrides)
    conn = KVConnector(engine.view, cfg, prefill=prefill)
    engine.evict_listeners.append(conn.on_evict)
    engine.step_listeners.append(conn.on_step)
    engine.metric_collectors.extend(conn.metrics.collectors())
    _install(engine, conn)
    return conn


def detach_tierkv(engine) -> None:
    conn = connector_of(engine)
    if conn is None:
        return
    _install(engine, remove=conn)
    if conn.on_evict in engine.evict_listeners:
        engine.evict_listeners.remove(conn.on_evict)
    if conn.on_step in engine.step_listeners:
        engine.step_listeners.remove(conn.on_step)
    conn.close()


def chunk_store(engine, config: BlendConfig) -> ChunkStore:
    """The daemon's store (an in-process LRU in front) when a connector is attached, so replicas
    share documents' KV; else the in-process LRU alone."""
    local = InProcessChunkStore(config.chunk_store_bytes)
    conn = connector_of(engine)
    if conn is None:
        return local
    client = KVStoreClient(conn.cfg.address, deadline_s=conn.cfg.offload_deadline_s, use_shm=conn.cfg.use_shm)
    return DaemonChunkStore(client, local=local)


def attach_cacheblend(engine, config: BlendConfig | None = None, store: ChunkStore | None = None) -> BlendHook:
    """Add the CacheBlend hook (raises BlendUnsupportedError if the model fails the RoPE self-check)."""
    config = config or BlendConfig()
    hook = BlendHook(engine.view, config, store if store is not None else chunk_store(engine, config))
    engine.metric_collectors.append(BlendCollector(hook.metrics))
    _install(engine, hook)
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
