"""The daemon's one frozen configuration object, loaded in one place.

Precedence (later wins): built-in defaults < YAML file (``--config``/``TIERKV_CONFIG``) <
environment (``TIERKV_*``) < CLI flags. Everything is validated in ``__post_init__`` so a bad
size string or a missing bucket stops the daemon at start, not at the first spill.

With no tier configured anywhere, the embedded default is a 1 GiB cpu tier over a 10 GiB disk
tier under ``$TIERKV_CACHE_DIR`` (default ``~/.cache/tierkv``). As soon as any tier is given,
only the given tiers exist.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from tiers.errors import ConfigError
from tiers.redact import redact_url

KINDS = ("cpu", "disk", "redis", "s3")
_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "ki": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mi": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gi": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "ti": 1024**4, "tib": 1024**4, "tb": 1000**4,
}  # fmt: skip
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int) -> int:
    """'4GiB' -> 4294967296; '1.5GB' -> 1500000000; plain ints are bytes."""
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"bad size {value!r} (examples: 512MiB, 4GiB, 1.5GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


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
    max_block_bytes: int = 64 * 1024**2
    max_batch_bytes: int = 256 * 1024**2  # one Put call (bounds memory: x workers)
    max_message_bytes: int = 8 * 1024**2  # gRPC message limit, both directions
    chunk_bytes: int = 4 * 1024**2  # streamed chunks (must fit in a message)
    workers: int = 8
    shm: bool = True  # allow the same-host shared-memory fast path
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

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ConfigError("at least one tier is required")
        kinds = [t.kind for t in self.tiers]
        if len(set(kinds)) != len(kinds):
            raise ConfigError(f"each tier kind may appear once, got {kinds}")
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
        from kvstore import auth  # local: keep config import-light

        auth.validate(self)


def _tier_from_flag(kind: str, value: str, env: Mapping[str, str]) -> TierConfig:
    """Parse '--cpu 4GiB', '--disk PATH[:SIZE]', '--s3 s3://b/p', '--redis redis://h:p'."""
    if kind == "cpu":
        return TierConfig("cpu", parse_size(value))
    if kind == "disk":
        path, sep, size = value.rpartition(":")
        if sep and _SIZE_RE.match(size) and path:
            return TierConfig("disk", parse_size(size), path=path)
        return TierConfig("disk", 10 * 1024**3, path=value)
    if kind == "s3":
        return TierConfig(
            "s3", 1024**4, url=value, shared=True, admit_min_hits=0,
            endpoint=env.get("AWS_ENDPOINT_URL", ""), region=env.get("AWS_DEFAULT_REGION", "us-east-1"),
            access_key_id=env.get("AWS_ACCESS_KEY_ID", ""), secret_access_key=env.get("AWS_SECRET_ACCESS_KEY", ""),
        )  # fmt: skip
    return TierConfig("redis", 4 * 1024**3, url=value, shared=True, write_through=True)


def _coerce(name: str, raw: Any, target: Any) -> Any:
    if isinstance(target, bool):
        return raw if isinstance(raw, bool) else str(raw).lower() in ("1", "true", "yes", "on")
    if isinstance(target, int):
        return parse_size(raw) if name.endswith("bytes") else int(raw)
    if isinstance(target, float):
        return float(raw)
    return str(raw)


def _tier_from_yaml(d: Mapping[str, Any], env: Mapping[str, str]) -> TierConfig:
    d = dict(d)
    kind = str(d.pop("kind", ""))
    if "capacity" in d:
        d["capacity_bytes"] = parse_size(d.pop("capacity"))
    if kind == "s3":
        d.setdefault("access_key_id", env.get("AWS_ACCESS_KEY_ID", ""))
        d.setdefault("secret_access_key", env.get("AWS_SECRET_ACCESS_KEY", ""))
        d.setdefault("shared", True)
    if kind == "redis":
        d.setdefault("shared", True)
    known = {f.name for f in fields(TierConfig)}
    if unknown := set(d) - known:
        raise ConfigError(f"{kind} tier: unknown keys {sorted(unknown)}")
    try:
        return TierConfig(kind=kind, **d)
    except TypeError as e:
        raise ConfigError(f"{kind} tier: {e}") from e


def build_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="kvstore serve")
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--cpu", help="cpu tier size, e.g. 4GiB")
    p.add_argument("--disk", help="disk tier PATH[:SIZE]")
    p.add_argument("--s3", help="s3 tier s3://bucket/prefix")
    p.add_argument("--s3-endpoint", help="S3 endpoint URL (SeaweedFS, MinIO)")
    p.add_argument("--s3-capacity", help="bytes the s3 tier may hold (default 1TiB)")
    p.add_argument("--s3-admit-hits", type=int, help="spill to s3 only blocks hit >= N times")
    p.add_argument("--redis", help="redis tier redis://host:port")
    p.add_argument("--redis-cluster", action="store_true", default=None)
    p.add_argument("--redis-capacity", help="bytes the redis tier may hold (default 4GiB)")
    p.add_argument("--eviction", help="eviction policy of every tier (lru, s3fifo, arc)")
    p.add_argument("--listen", help="HOST:PORT to serve gRPC on")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus /metrics on 127.0.0.1:N")
    p.add_argument("--metrics-listen", help="serve Prometheus /metrics on HOST:PORT (e.g. 0.0.0.0:9400)")
    p.add_argument("--shm-max-bytes", help="shared memory all clients may map, e.g. 4GiB (default)")
    p.add_argument("--check-config", action="store_true", help="validate the configuration and exit")
    p.add_argument("--no-promote", action="store_true", default=None, help="do not promote on hit")
    p.add_argument("--no-shm", action="store_true", default=None, help="disable the shared-memory path")
    p.add_argument("--no-stream", action="store_true", default=None, help="disable the raw TCP Get channel")
    p.add_argument("--stream-port", type=int, help="port of the raw TCP Get channel (default: any free one)")
    p.add_argument("--token-file", help="file holding the bearer token clients must send (default: "
                   "$TIERKV_CACHE_DIR or $XDG_RUNTIME_DIR/tierkv, /token, created 0600); or env TIERKV_TOKEN")
    p.add_argument("--no-auth", action="store_true", default=None,
                   help="accept calls without a token: UNSAFE beyond loopback (anyone reaching the port reads "
                   "and writes the cache)")
    p.add_argument("--tls-cert", help="PEM certificate: serve gRPC over TLS (with --tls-key)")
    p.add_argument("--tls-key", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", help="PEM CA: require client certificates it signed (mutual TLS)")
    return p


_SCALARS = [f.name for f in fields(StoreConfig) if f.name != "tiers"]


def load_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> StoreConfig:
    """The one place a StoreConfig is assembled: YAML, then TIERKV_* env, then CLI flags."""
    env = dict(os.environ if env is None else env)
    args = build_arg_parser().parse_args(list(argv or []))
    path = args.config or env.get("TIERKV_CONFIG")
    doc: dict[str, Any] = {}
    if path:
        try:
            doc = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from e
        if not isinstance(doc, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
    tiers: dict[str, TierConfig] = {}
    for t in doc.pop("tiers", []) or []:
        tc = _tier_from_yaml(t, env)
        tiers[tc.kind] = tc
    scalars: dict[str, Any] = {}
    defaults = StoreConfig(tiers=(TierConfig("cpu", 1),))
    for name, raw in doc.items():
        if name not in _SCALARS:
            raise ConfigError(f"{path}: unknown key {name!r}")
        scalars[name] = _coerce(name, raw, getattr(defaults, name))
    for name in _SCALARS:  # env overrides
        if (raw := env.get(f"TIERKV_{name.upper()}")) is not None:
            scalars[name] = _coerce(name, raw, getattr(defaults, name))
    flags = {"cpu": args.cpu, "disk": args.disk, "s3": args.s3, "redis": args.redis}
    for kind in KINDS:
        value = flags[kind] or env.get(f"TIERKV_{kind.upper()}")
        if value:
            tiers[kind] = _tier_from_flag(kind, value, env)
    if "s3" in tiers:
        s3 = tiers["s3"]
        endpoint = args.s3_endpoint or env.get("TIERKV_S3_ENDPOINT") or s3.endpoint
        cap = args.s3_capacity or env.get("TIERKV_S3_CAPACITY")
        hits = args.s3_admit_hits if args.s3_admit_hits is not None else s3.admit_min_hits
        tiers["s3"] = replace(
            s3, endpoint=endpoint, admit_min_hits=hits, capacity_bytes=parse_size(cap) if cap else s3.capacity_bytes
        )
    if "redis" in tiers:
        r = tiers["redis"]
        cap = args.redis_capacity or env.get("TIERKV_REDIS_CAPACITY")
        cluster = args.redis_cluster or _coerce("c", env.get("TIERKV_REDIS_CLUSTER", r.cluster), True)
        tiers["redis"] = replace(r, cluster=cluster, capacity_bytes=parse_size(cap) if cap else r.capacity_bytes)
    if not tiers:
        cache = default_cache_dir(env)
        tiers = {"cpu": TierConfig("cpu", 1024**3), "disk": TierConfig("disk", 10 * 1024**3, path=str(cache / "disk"))}
    if args.eviction:
        tiers = {k: replace(t, eviction=args.eviction) for k, t in tiers.items()}
    for name, val in (("listen", args.listen), ("metrics_port", args.metrics_port),
                      ("metrics_listen", args.metrics_listen)):
        if val is not None:
            scalars[name] = val
    if args.shm_max_bytes is not None:
        scalars["shm_max_bytes"] = parse_size(args.shm_max_bytes)
    if args.no_promote:
        scalars["promote_on_hit"] = False
    if args.no_shm:
        scalars["shm"] = False
    if args.stream_port is not None:
        scalars["stream_port"] = args.stream_port
    if args.no_stream:
        scalars["stream"] = False
    for name in ("token_file", "tls_cert", "tls_key", "tls_client_ca"):
        if (val := getattr(args, name)) is not None:
            scalars[name] = val
    if args.no_auth:
        scalars["auth"] = False
    return StoreConfig(tiers=tuple(tiers.values()), **scalars)
