"""The daemon's one frozen configuration, StoreConfig (a TierConfig per level), and where it comes from.

The rest of the code reads only these dataclasses; ``load_settings`` (``load_config``) is the one
place they are assembled: defaults, YAML, ``TIERKV_*`` env and flags (the flag table, with each
flag's variable: kvstore/config/flags.py), merged field by field. Sizes: kvstore/config/sizes.py
(Kubernetes units).

Precedence, per field (later wins): built-in default < YAML file (``--config`` or
``TIERKV_CONFIG``) < environment < command-line flag. Tiers merge by kind and by field: ``--cpu 8Gi``
changes the cpu tier's capacity and keeps its YAML eviction policy; ``--redis URL`` changes the
URL of a YAML redis tier and keeps its capacity and TTL. With no tier configured anywhere the
embedded default is a 1 GiB cpu tier over a 10 GiB disk tier under ``$TIERKV_CACHE_DIR/disk``.

Every value then passes one pydantic model (built from the StoreConfig/TierConfig fields, so a new
field needs no second declaration); a bad one is one line naming the field, where it came from and
what is allowed. Unknown YAML keys and unknown ``TIERKV_*`` variables are warnings, with the
closest valid name. The frozen dataclasses' own ``__post_init__`` keeps the cross-field rules,
so a StoreConfig built by hand (tests, embedding) is held to them too.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from functools import cache
from pathlib import Path as FsPath
from typing import Annotated, Any, Literal, NamedTuple

from kvstore import env_names
from kvstore.config.flags import CONFIG_ENV, Path, build_arg_parser, flag_values, tier_env_values
from kvstore.config.sizes import format_size, parse_size
from tiers.errors import ConfigError
from tiers.redact import redact_url

__all__ = ["KINDS", "Settings", "StoreConfig", "TierConfig", "default_cache_dir", "effective_lines", "load_config",
           "load_settings"]
KINDS = ("cpu", "disk", "redis", "s3")
MAX_REPLAY_BACKLOG_KEYS = 16 * 1024**2  # a key and its dict slot cost ~100 B: 1.6 GB per shared tier at most


def default_cache_dir(env: Mapping[str, str] | None = None) -> FsPath:
    env = os.environ if env is None else env
    return FsPath(env.get("TIERKV_CACHE_DIR") or FsPath.home() / ".cache" / "tierkv")


@dataclass(frozen=True)
class TierConfig:
    """One level of the chain."""

    kind: str
    capacity_bytes: int
    eviction: str = "lru"  # eviction policy: lru, s3fifo, arc (kvstore/store/eviction.py)
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
    # secrets as files (kvstore/config/tier_secrets.py): read at start, never shown
    password_file: str = ""  # redis: the server's password (AUTH), kept out of the url
    access_key_id_file: str = ""  # s3: the keys, instead of access_key_id / secret_access_key
    secret_access_key_file: str = ""
    tls_ca: str = ""  # redis: CA of a rediss:// server's certificate; s3: CA bundle of an https endpoint

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
        from kvstore.store.eviction import EVICTION_POLICIES  # local: keep config import-light

        if self.eviction.lower().replace("-", "").replace("_", "") not in EVICTION_POLICIES:
            raise ConfigError(f"{self.kind}: unknown eviction policy {self.eviction!r}")
        from kvstore.config import tier_secrets

        tier_secrets.validate_tier(self)

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


def _positive(cfg: object, *names: str) -> None:
    for name in names:
        if not getattr(cfg, name) > 0:
            raise ConfigError(f"{name} must be > 0, got {getattr(cfg, name)}")


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
    tier_retry_s: float = 2.0  # first probe of a detached tier; doubles up to 10x (kvstore/store/breaker.py)
    tier_detach_after: int = 3  # consecutive errors that detach a tier (kvstore/store/breaker.py)
    ghosts_per_tier: int = 16384  # recently evicted keys each tier remembers, for miss reasons (kvstore/store/miss_reasons.py)
    max_block_bytes: int = 64 * 1024**2
    max_batch_bytes: int = 256 * 1024**2  # one Put call (bounds memory: x workers)
    max_message_bytes: int = 8 * 1024**2  # gRPC message limit, both directions
    chunk_bytes: int = 4 * 1024**2  # streamed chunks (must fit in a message)
    workers: int = 8
    shm: bool = True  # allow the same-host shared-memory fast path
    shm_arena: bool = True  # ... and let clients map the cpu tier read-only: its Gets then copy nothing here
    grace_s: float = 30.0  # SIGTERM: time to finish in-flight calls and spills
    shm_max_bytes: int = 4 * 1024**3  # shared memory all clients' segments may map; past it clients stream
    shm_socket: str = ""  # unix socket clients hand their segments over on ("" = <runtime dir>/shm-<port>.sock)
    stream: bool = True  # serve Gets without shared memory on a raw TCP side channel (kvstore/server/stream_server.py)
    stream_port: int = 0  # the side channel's port (0 = any free one; fix it to publish it from a container)
    stream_max_conns: int = 16  # side-channel connections (and unused tokens) at once; past it: gRPC streaming
    auth: bool = True  # require a bearer token on every gRPC call but health (kvstore/server/auth.py)
    token: str = field(default="", repr=False)  # TIERKV_TOKEN; "" = token_file
    token_file: str = ""  # "" = <runtime dir>/token, created 0600 when missing
    credentials_file: str = ""  # YAML: tokens -> tenants, admin (kvstore/server/credentials.py); "" = the one token is admin
    tls_cert: str = ""  # PEM files: serve gRPC over TLS ...
    tls_key: str = ""
    tls_client_ca: str = ""  # ... and require client certificates signed by this CA (mutual TLS)
    min_block_bytes: int = 4 * 1024  # no KV page is smaller (16 tokens x 1 layer x K,V x 64 dims x fp16): a tier below it is refused
    stats_interval_s: float = 60.0  # log a one-line stats summary this often (0 = never)
    tenant_quota_bytes: int = 0  # bytes each tenant may hold in the top tier; over it, its own oldest spill (0 = off)
    mac_secret_file: str = ""  # signs every block written to redis/s3; "" = <runtime dir>/mac_secret, created 0600
    mac_previous_secret_files: str = ""  # comma-separated: earlier secrets, still accepted, never signing (rotation)
    # -- limits on what clients and tiers may hold or cost: each one bounded (#22)
    tier_error_window: int = 20  # the circuit breaker's error rate is taken over a tier's last N calls ...
    tier_error_rate: float = 0.5  # ... and detaches it when at least this share of them failed ...
    tier_error_min_calls: int = 10  # ... once the window holds at least this many (kvstore/store/breaker.py)
    replay_backlog_keys: int = 65536  # keys a shared tier remembers of writes skipped while detached, replayed at attach (0 = off)
    replay_park_bytes: int = 64 * 1024**2  # blocks evicted with nowhere to land while they await a replay, kept in memory (0 = off)
    spill_put_timeout_s: float = 5.0  # a call finding the spill queue full waits this long; then its block is not stored below
    traces_dir: str = ""  # TraceStart writes only here ("" = $TIERKV_CACHE_DIR/traces)
    trace_max_records: int = 4_000_000  # the largest trace ring a TraceStart may ask for (24 B a record: 96 MB)
    max_put_streams: int = 0  # Put streams at once (0 = half the workers), so reads find a worker; past it: UNAVAILABLE
    put_stream_timeout_s: float = 15.0  # a Put stream not read to its commit in this is cancelled, nothing of it stored
    max_keys_per_call: int = 4096  # keys in one Lookup/Get/Put/Delete or raw-channel request (65,536 tokens at 16 a page)
    max_concurrent_rpcs: int = 128  # gRPC calls running or queued at once; past it a call is refused RESOURCE_EXHAUSTED
    keepalive_time_s: float = 60.0  # ping every client connection this often ...
    keepalive_timeout_s: float = 20.0  # ... and drop it (and its calls) when a ping is not answered in this
    max_connection_idle_s: float = 900.0  # close a connection that ran no call for this long (clients reconnect)
    min_client_ping_interval_s: float = 30.0  # a client pinging more often than this is sent away (GOAWAY)
    health_max_watches: int = 16  # health Watch streams at once (health needs no token)
    metrics_timeout_s: float = 10.0  # an HTTP connection to /metrics silent this long is closed
    tenant_fair_share: bool = False  # top tier full: evict first from a tenant above capacity / tenants there

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
        if self.shm_socket and not self.shm_socket.startswith("/"):
            raise ConfigError(f"shm_socket must be an absolute path, got {self.shm_socket!r}")
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
        self._check_limits()
        from kvstore.server import auth  # local: keep config import-light

        auth.validate(self)

    def _check_limits(self) -> None:
        """The bounds on what clients and tiers may hold or cost (#22), each one line naming its field."""
        if self.tier_error_window < 1 or not 1 <= self.tier_error_min_calls <= self.tier_error_window:
            raise ConfigError(f"tier_error_window must be >= 1 and tier_error_min_calls in 1..tier_error_window, got "
                              f"{self.tier_error_window} and {self.tier_error_min_calls}")
        if not 0 < self.tier_error_rate <= 1:
            raise ConfigError(f"tier_error_rate must be in (0, 1], got {self.tier_error_rate}")
        if not 0 <= self.replay_backlog_keys <= MAX_REPLAY_BACKLOG_KEYS:
            raise ConfigError(f"replay_backlog_keys must be in 0..{MAX_REPLAY_BACKLOG_KEYS} (0 = no replay), got "
                              f"{self.replay_backlog_keys}")
        if self.replay_park_bytes < 0:
            raise ConfigError(f"replay_park_bytes must be >= 0 (0 = none kept), got {self.replay_park_bytes}")
        _positive(self, "spill_put_timeout_s")
        from kvstore.ops.trace import MAX_RECORDS  # local: keep config import-light

        if not 1 <= self.trace_max_records <= MAX_RECORDS:
            raise ConfigError(f"trace_max_records must be in 1..{MAX_RECORDS}, got {self.trace_max_records}")
        if not 0 <= self.max_put_streams <= self.workers:
            raise ConfigError(f"max_put_streams must be in 0..workers ({self.workers}; 0 = half of them), got "
                              f"{self.max_put_streams}")
        _positive(self, "put_stream_timeout_s")
        if not 1 <= self.max_keys_per_call <= 65536:
            raise ConfigError(f"max_keys_per_call must be in 1..65536, got {self.max_keys_per_call}")
        if self.max_concurrent_rpcs < 1:
            raise ConfigError(f"max_concurrent_rpcs must be >= 1, got {self.max_concurrent_rpcs}")
        _positive(self, "keepalive_time_s", "keepalive_timeout_s", "max_connection_idle_s", "min_client_ping_interval_s")
        if self.health_max_watches < 0:
            raise ConfigError(f"health_max_watches must be >= 0, got {self.health_max_watches}")
        _positive(self, "metrics_timeout_s")

    @property
    def traces_path(self) -> FsPath:
        """The one directory TraceStart writes trace files in."""
        return FsPath(self.traces_dir) if self.traces_dir else default_cache_dir() / "traces"

    @property
    def put_streams(self) -> int:
        """Put streams open at once: ``max_put_streams``, or half the workers (at least one)."""
        return self.max_put_streams or max(1, self.workers // 2)


log = logging.getLogger("kvstore.config")
SCALARS = tuple(f.name for f in fields(StoreConfig) if f.name != "tiers")
TIER_FIELDS = tuple(f.name for f in fields(TierConfig))
SECRETS = frozenset({"token", "access_key_id", "secret_access_key"})
KIND_DEFAULTS: dict[str, dict[str, Any]] = {  # what a tier of each kind is unless told otherwise
    "cpu": {"capacity_bytes": 1024**3},
    "disk": {"capacity_bytes": 10 * 1024**3},
    "redis": {"capacity_bytes": 4 * 1024**3, "shared": True, "write_through": True},
    "s3": {"capacity_bytes": 1024**4, "shared": True},
}
_S3_ENV = {"endpoint": "AWS_ENDPOINT_URL", "region": "AWS_DEFAULT_REGION", "access_key_id": "AWS_ACCESS_KEY_ID",
           "secret_access_key": "AWS_SECRET_ACCESS_KEY"}
_REQUIRED = {"disk": ("path", "--disk PATH[:SIZE], TIERKV_DISK or a YAML tier's path"),
             "redis": ("url", "--redis redis://host:port/db, TIERKV_REDIS or a YAML tier's url"),
             "s3": ("url", "--s3 s3://bucket/prefix, TIERKV_S3 or a YAML tier's url")}
Layer = dict[Path, tuple[Any, str]]  # path -> (value, where it came from)


class Settings(NamedTuple):
    config: StoreConfig
    sources: dict[Path, str]  # where each field's value came from ("default", "--cpu", "TIERKV_LISTEN", ...)
    warnings: list[str]


def _pyd_type(name: str, declared: str) -> Any:
    from pydantic import BeforeValidator

    if name == "kind":
        return Literal[KINDS]  # type: ignore[valid-type]
    if declared == "int" and name.endswith("_bytes"):
        return Annotated[int, BeforeValidator(parse_size)]
    return {"int": int, "float": float, "bool": bool, "str": str}[declared]


def _model(cls: type, name: str, extra: Mapping[str, Any] = {}) -> Any:  # noqa: B006 - read only
    from pydantic import create_model

    spec = {f.name: (_pyd_type(f.name, str(f.type)), ...) for f in fields(cls) if f.name not in extra}
    return create_model(name, __config__={"extra": "forbid"}, **spec, **{k: (v, ...) for k, v in extra.items()})


@cache
def _store_model() -> Any:
    """The pydantic model every loaded value passes; built on first use, so that importing StoreConfig
    (the servicer, ``kvstore health``) imports neither pydantic nor yaml."""
    tier_model = _model(TierConfig, "TierSettings")
    return _model(StoreConfig, "StoreSettings", {"tiers": list[tier_model]})  # type: ignore[valid-type]


def _closest(name: str, valid: Sequence[str]) -> str:
    match = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


@dataclass
class _Yaml:
    layer: Layer
    kinds: list[str]
    warnings: list[str]


def _read_yaml(path: str) -> _Yaml:
    import yaml

    try:
        doc = yaml.safe_load(FsPath(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config {path}: {' '.join(str(e).split())}") from None
    doc = {} if doc is None else doc
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of settings, got {type(doc).__name__}")
    out = _Yaml({}, [], [])
    for key, value in doc.items():
        if key == "tiers":
            _read_yaml_tiers(path, value, out)
        elif key in SCALARS:
            out.layer[(key,)] = (value, f"{path}: {key}")
        else:
            out.warnings.append(f"{path}: unknown key {key!r} ignored{_closest(str(key), (*SCALARS, 'tiers'))}")
    return out


def _read_yaml_tiers(path: str, tiers: Any, out: _Yaml) -> None:
    if not isinstance(tiers, list):
        raise ConfigError(f"{path}: tiers must be a list of mappings with a kind, got {type(tiers).__name__}")
    keys = (*TIER_FIELDS, "capacity")
    for i, tier in enumerate(tiers):
        where = f"{path}: tiers[{i}]"
        if not isinstance(tier, dict) or tier.get("kind") not in KINDS:
            got = tier.get("kind") if isinstance(tier, dict) else tier
            raise ConfigError(f"{where}.kind = {got!r}: must be one of {', '.join(KINDS)}")
        kind = tier["kind"]
        if kind in out.kinds:
            raise ConfigError(f"{where}: a second {kind} tier (tiers[{out.kinds.index(kind)}] is one): "
                              "each kind may appear once")
        out.kinds.append(kind)
        for key, value in tier.items():
            name = "capacity_bytes" if key == "capacity" else key
            if key not in keys or key == "kind":
                if key != "kind":
                    out.warnings.append(f"{where} ({kind}): unknown key {key!r} ignored{_closest(str(key), keys)}")
                continue
            out.layer[("tiers", kind, name)] = (value, f"{where}.{key}")


def _chain(listed: Sequence[str], added: Sequence[str]) -> list[str]:
    """The YAML's tier order, with tiers added by env or flags at their place in cpu > disk > redis > s3."""
    out = list(listed)
    for kind in added:
        later = [i for i, k in enumerate(out) if KINDS.index(k) > KINDS.index(kind)]
        out.insert(later[0] if later else len(out), kind)
    return out


def _env_layer(env: Mapping[str, str]) -> Layer:
    layer: Layer = {}
    for name in SCALARS:
        if (raw := env.get(f"TIERKV_{name.upper()}")) is not None:
            layer[(name,)] = (raw, f"TIERKV_{name.upper()}")
    for option, values in tier_env_values(dict(env)):
        layer.update({path: (v, option.env) for path, v in values.items()})
    return layer


def _defaults(kinds: Sequence[str], env: Mapping[str, str], embedded: bool) -> Layer:
    layer: Layer = {(f.name,): (f.default, "default") for f in fields(StoreConfig) if f.default is not MISSING}
    for kind in kinds:
        for f in fields(TierConfig):
            if f.default is not MISSING:
                layer[("tiers", kind, f.name)] = (f.default, "default")
        layer[("tiers", kind, "kind")] = (kind, "default")
        layer.update({("tiers", kind, k): (v, "default") for k, v in KIND_DEFAULTS[kind].items()})
    if "s3" in kinds:
        layer[("tiers", "s3", "region")] = ("us-east-1", "default")
        for name, var in _S3_ENV.items():
            if env.get(var):
                layer[("tiers", "s3", name)] = (env[var], var)
    if embedded:
        layer[("tiers", "disk", "path")] = (str(default_cache_dir(env) / "disk"), "default ($TIERKV_CACHE_DIR)")
    return layer


def load_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """The StoreConfig of ``kvstore serve ARGV`` under ``env``, where each value came from, and warnings.

    Raises ConfigError (one line per bad value) for anything invalid; never a traceback."""
    env = dict(os.environ if env is None else env)
    args = build_arg_parser().parse_args(list(argv or []))
    path = args.config or env.get(CONFIG_ENV)
    yml = _read_yaml(path) if path else _Yaml({}, [], [])
    env_layer = _env_layer(env)
    flag_layer: Layer = {}
    for option, values in flag_values(args):
        flag_layer.update({p: (v, option.flag) for p, v in values.items()})
    given = [p[1] for lay in (yml.layer, env_layer, flag_layer) for p in lay if p[:1] == ("tiers",) and p[1] != "*"]
    kinds = _chain(yml.kinds, [k for k in KINDS if k in given and k not in yml.kinds])
    embedded = not kinds
    kinds = kinds or ["cpu", "disk"]
    merged: Layer = {}
    for layer in (_defaults(kinds, env, embedded), yml.layer, env_layer, flag_layer):
        for p, value in layer.items():
            for target in ([("tiers", k, *p[2:]) for k in kinds] if p[1:2] == ("*",) else [p]):
                merged[target] = value
    config = _validate(merged, kinds)
    warnings = yml.warnings + env_names.unknown(env)
    for line in warnings:
        log.warning("%s", line)
    return Settings(config, {p: src for p, (_, src) in merged.items()}, warnings)


def _validate(merged: Layer, kinds: Sequence[str]) -> StoreConfig:
    doc: dict[str, Any] = {"tiers": [{} for _ in kinds]}
    for p, (value, _) in merged.items():
        if p[0] == "tiers":
            doc["tiers"][kinds.index(p[1])][p[2]] = value
        else:
            doc[p[0]] = value
    from pydantic import ValidationError

    try:
        model = _store_model().model_validate(doc)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = err["loc"]
            p = ("tiers", kinds[loc[1]], *map(str, loc[2:])) if loc[0] == "tiers" and len(loc) > 2 else tuple(
                map(str, loc))
            value, source = merged.get(p, (None, "?"))
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{_name(p)} = {_shown(p, value)} (from {source}): {msg}")
        raise ConfigError("\n".join(lines)) from None
    data = model.model_dump()
    for t in data["tiers"]:
        need, how = _REQUIRED.get(t["kind"], ("", ""))
        if need and not t[need]:
            why = sorted({src for p, (_, src) in merged.items() if p[:2] == ("tiers", t["kind"]) and src != "default"})
            raise ConfigError(f"{t['kind']} tier {need} is required ({how}); the tier is configured by {', '.join(why)}")
    tiers = tuple(TierConfig(**t) for t in data.pop("tiers"))
    return StoreConfig(tiers=tiers, **data)


def _name(p: Path) -> str:
    return f"{p[1]} tier {p[2]}" if p[0] == "tiers" and len(p) > 2 else ".".join(p)


def _shown(p: Path, value: Any) -> str:
    """A value as logs may show it: secrets masked, URL passwords masked."""
    if p[-1] in SECRETS:
        return "'***'" if value else "''"
    if p[-1] in ("url", "endpoint") and isinstance(value, str):
        return repr(redact_url(value))
    return repr(value)


def effective_lines(settings: Settings) -> list[str]:
    """The effective configuration, one ``field = value  (source)`` per line, secrets masked."""
    cfg = settings.config
    lines = [f"{name} = {_shown((name,), getattr(cfg, name))}  ({settings.sources.get((name,), 'default')})"
             for name in SCALARS]
    defaults = {f.name: f.default for f in fields(TierConfig)}
    for t in cfg.tiers:
        for name in TIER_FIELDS:
            p = ("tiers", t.kind, name)
            if name == "capacity_bytes" or (name != "kind" and getattr(t, name) != defaults[name]):
                lines.append(f"{_name(p)} = {_shown(p, getattr(t, name))}  ({settings.sources.get(p, 'default')})")
    return lines


def load_config(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> StoreConfig:
    """The StoreConfig of ``kvstore serve ARGV`` under ``env`` (default os.environ)."""
    return load_settings(argv, env).config
