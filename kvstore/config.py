"""The daemon's one frozen configuration object: StoreConfig (and a TierConfig per level).

The rest of the code reads only these dataclasses. They are assembled in one place,
kvstore/settings.py (YAML < ``TIERKV_*`` env < flags, merged field by field and type-checked by a
pydantic model); ``__post_init__`` here keeps the cross-field rules, so a StoreConfig built by hand
(tests, embedding) is held to them too. Sizes: kvstore/sizes.py (Kubernetes units).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from kvstore.sizes import format_size, parse_size
from tiers.errors import ConfigError
from tiers.redact import redact_url

__all__ = ["KINDS", "StoreConfig", "TierConfig", "default_cache_dir", "load_config", "parse_size"]
KINDS = ("cpu", "disk", "redis", "s3")
def default_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("TIERKV_CACHE_DIR") or Path.home() / ".cache" / "tierkv")


@dataclass(frozen=True)
class TierConfig:
    """One level of the chain."""

    kind: str
    capacity_bytes: int
    eviction: str = "lru"  # eviction policy: lru, s3fifo, arc (kvstore/eviction.py)
    path: str = ""  # disk: lmdb directory
    url: str = ""  # s3://bucket/prefix or redis://host:port/db
    endpoint: str = ""  # s3 endpoint URL (SeaweedFS, MinIO); empty = AWS
    cluster: bool = False  # redis: use redis-py's cluster client
    ttl_s: int = 0  # redis: key TTL (0 = none)
    write_through: bool = False  # copy every put here at once (shared remote tiers)
    admit_min_hits: int = 0  # spill here only blocks hit at least this often; others are dropped
    shared: bool = False  # other nodes write here too: consult the tier itself on index misses
    huge_pages: bool = False  # cpu: back the shared arena with reserved hugetlb pages (falls back, logged)
    region: str = ""
    access_key_id: str = field(default="", repr=False)
    secret_access_key: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"unknown tier kind {self.kind!r}; choose from {KINDS}")
        if self.capacity_bytes <= 0:
            raise ConfigError(f"{self.kind}: capacity must be > 0")
        if self.kind == "disk" and not self.path:
            raise ConfigError("disk tier needs a path")
        if self.kind == "s3" and not self.url.startswith("s3://"):
            raise ConfigError(f"s3 tier needs an s3://bucket/prefix url, got {self.url!r}")
        if self.kind == "redis" and not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ConfigError(f"redis tier needs a redis:// url, got {redact_url(self.url)!r}")
        if self.huge_pages and self.kind != "cpu":
            raise ConfigError(f"{self.kind}: huge_pages applies to the cpu tier only")
        if self.admit_min_hits < 0 or self.ttl_s < 0:
            raise ConfigError(f"{self.kind}: admit_min_hits and ttl_s must be >= 0")
        from kvstore.eviction import EVICTION_POLICIES  # local: keep config import-light

        if self.eviction.lower().replace("-", "").replace("_", "") not in EVICTION_POLICIES:
            raise ConfigError(f"{self.kind}: unknown eviction policy {self.eviction!r}")

    def __repr__(self) -> str:
        """Fields that differ from their defaults; the URL's password masked, S3 keys left out."""
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.repr and value != f.default:
                shown.append(f"{f.name}={redact_url(value)!r}" if f.name == "url" else f"{f.name}={value!r}")
        return f"TierConfig({', '.join(shown)})"

    @property
    def bucket_prefix(self) -> tuple[str, str]:
        rest = self.url[len("s3://") :]
        bucket, _, prefix = rest.partition("/")
        return bucket, prefix


def _check_host_port(name: str, value: str) -> None:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"{name} must be HOST:PORT, got {value!r}")


@dataclass(frozen=True)
class StoreConfig:
    tiers: tuple[TierConfig, ...]
    listen: str = "127.0.0.1:50551"
    metrics_port: int = 0  # 0 = no /metrics endpoint (served on 127.0.0.1; see metrics_listen)
    metrics_listen: str = ""  # HOST:PORT for /metrics; overrides metrics_port (e.g. 0.0.0.0:9400 in a pod)
    promote_on_hit: bool = True
    spill_queue_bytes: int = 256 * 1024**2  # bytes waiting to spill before puts block
    tier_retry_s: float = 2.0  # first probe of a detached tier; doubles up to 10x (kvstore/breaker.py)
    tier_detach_after: int = 3  # consecutive errors that detach a tier (kvstore/breaker.py)
    ghosts_per_tier: int = 16384  # recently evicted keys each tier remembers, for miss reasons (kvstore/ghosts.py)
    max_block_bytes: int = 64 * 1024**2
    max_batch_bytes: int = 256 * 1024**2  # one Put call (bounds memory: x workers)
    max_message_bytes: int = 8 * 1024**2  # gRPC message limit, both directions
    chunk_bytes: int = 4 * 1024**2  # streamed chunks (must fit in a message)
    workers: int = 8
    shm: bool = True  # allow the same-host shared-memory fast path
    shm_arena: bool = True  # ... and let clients map the cpu tier read-only: its Gets then copy nothing here
    grace_s: float = 30.0  # SIGTERM: time to finish in-flight calls and spills
    shm_max_bytes: int = 4 * 1024**3  # shared memory all clients' segments may map; past it clients stream
    stream: bool = True  # serve Gets without shared memory on a raw TCP side channel (kvstore/stream_server.py)
    stream_port: int = 0  # the side channel's port (0 = any free one; fix it to publish it from a container)
    stream_max_conns: int = 16  # side-channel connections (and unused tokens) at once; past it: gRPC streaming
    auth: bool = True  # require a bearer token on every gRPC call but health (kvstore/auth.py)
    token: str = field(default="", repr=False)  # TIERKV_TOKEN; "" = token_file
    token_file: str = ""  # "" = <runtime dir>/token, created 0600 when missing
    tls_cert: str = ""  # PEM files: serve gRPC over TLS ...
    tls_key: str = ""
    tls_client_ca: str = ""  # ... and require client certificates signed by this CA (mutual TLS)
    min_block_bytes: int = 4 * 1024  # no KV page is smaller (16 tokens x 1 layer x K,V x 64 dims x fp16): a tier below it is refused
    stats_interval_s: float = 60.0  # log a one-line stats summary this often (0 = never)
    tenant_quota_bytes: int = 0  # bytes each tenant may hold in the top tier; over it, its own oldest spill (0 = off)

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ConfigError("at least one tier is required")
        kinds = [t.kind for t in self.tiers]
        if len(set(kinds)) != len(kinds):
            raise ConfigError(f"each tier kind may appear once, got {kinds}")
        for t in self.tiers:
            if t.capacity_bytes < self.min_block_bytes:
                raise ConfigError(
                    f"{t.kind} tier: capacity {t.capacity_bytes} B is smaller than one block (min_block_bytes = "
                    f"{format_size(self.min_block_bytes)}); sizes without a unit are bytes: did you mean "
                    f"{t.capacity_bytes}Mi or {t.capacity_bytes}Gi?")
        if self.tenant_quota_bytes and not self.min_block_bytes <= self.tenant_quota_bytes:
            raise ConfigError(
                f"tenant_quota_bytes {self.tenant_quota_bytes} B is smaller than one block (min_block_bytes = "
                f"{format_size(self.min_block_bytes)}): no tenant could keep a block in the top tier; 0 turns the "
                f"quota off; sizes without a unit are bytes: did you mean {self.tenant_quota_bytes}Mi?")
        if self.stats_interval_s < 0:
            raise ConfigError(f"stats_interval_s must be >= 0 (0 = off), got {self.stats_interval_s}")
        _check_host_port("listen", self.listen)
        if self.metrics_listen:
            _check_host_port("metrics_listen", self.metrics_listen)
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"bad metrics port {self.metrics_port}")
        if not 0 <= self.stream_port < 65536:
            raise ConfigError(f"stream_port must be in 0..65535, got {self.stream_port}")
        if self.stream_max_conns < 1:
            raise ConfigError(f"stream_max_conns must be >= 1, got {self.stream_max_conns}")
        if self.shm_max_bytes <= 0:
            raise ConfigError(f"shm_max_bytes must be > 0, got {self.shm_max_bytes}")
        if self.chunk_bytes + 64 * 1024 > self.max_message_bytes:
            raise ConfigError("chunk_bytes must leave room under max_message_bytes")
        if self.max_block_bytes > self.max_batch_bytes or self.workers < 1 or self.spill_queue_bytes <= 0:
            raise ConfigError("invalid limits (max_block_bytes <= max_batch_bytes, workers >= 1)")
        if self.tier_detach_after < 1:
            raise ConfigError(f"tier_detach_after must be >= 1, got {self.tier_detach_after}")
        if self.ghosts_per_tier < 0:
            raise ConfigError(f"ghosts_per_tier must be >= 0, got {self.ghosts_per_tier}")
        if not 0 < self.min_block_bytes <= self.max_block_bytes:
            raise ConfigError(f"min_block_bytes must be in 1..max_block_bytes, got {self.min_block_bytes}")
        from kvstore import auth  # local: keep config import-light

        auth.validate(self)


def load_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> StoreConfig:
    """The StoreConfig of ``kvstore serve ARGV`` under ``env`` (default os.environ): kvstore/settings.py."""
    from kvstore.settings import load_settings  # local: settings imports this module

    return load_settings(argv, env).config
