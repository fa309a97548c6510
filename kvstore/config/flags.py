"""`kvstore serve`'s flags, each with the ``TIERKV_*`` variable that sets the same thing.

One table (OPTIONS) drives argparse, ``--help`` (every flag shows its default and its variable)
and the env/flag layers of kvstore/config/store_config.py, so a flag and its variable cannot drift apart.
A value lands on a *path*: ``("listen",)`` for a StoreConfig field, ``("tiers", "cpu",
"capacity_bytes")`` for one field of one tier (``"*"`` = every tier), so a flag changes that field
only and the rest of a YAML tier stays. Values stay strings here: the pydantic model in
kvstore/config/store_config.py checks them, whichever layer they came from.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

Path = tuple[str, ...]
_LOOKS_LIKE_SIZE = re.compile(r"^\s*\.?\d")


def _disk(value: str) -> dict[Path, str]:
    """``PATH[:SIZE]``: the part after the last colon is a size when it starts with a digit."""
    path, sep, size = value.rpartition(":")
    if sep and path and _LOOKS_LIKE_SIZE.match(size):
        return {("tiers", "disk", "path"): path, ("tiers", "disk", "capacity_bytes"): size}
    return {("tiers", "disk", "path"): value}


@dataclass(frozen=True)
class Option:
    """One flag: where its value goes, the variable that sets the same, what --help says."""

    flag: str
    env: str  # the TIERKV_* variable with the same effect (a switch's is its field's: true/false)
    help: str
    default: str  # as shown by --help
    target: Path = ()  # where the value goes (empty: ``split`` decides)
    split: Callable[[str], dict[Path, str]] | None = None  # a composite value (--disk PATH[:SIZE])
    switch: Any = None  # a value-less flag sets ``target`` to this

    def values(self, raw: str) -> dict[Path, Any]:
        return self.split(raw) if self.split is not None else {self.target: raw}

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def _scalar(flag: str, field: str, help: str, default: str, switch: Any = None) -> Option:
    return Option(flag, f"TIERKV_{field.upper()}", help, default, (field,), switch=switch)


OPTIONS: tuple[Option, ...] = (
    Option("--cpu", "TIERKV_CPU", "cpu tier size, e.g. 4Gi (sizes: Gi = 2^30, G = 10^9, bare = bytes)",
           "1Gi, with the disk tier, when no tier is configured", ("tiers", "cpu", "capacity_bytes")),
    Option("--cpu-huge-pages", "TIERKV_CPU_HUGE_PAGES", "back the cpu tier's shared arena with reserved hugetlb "
           "pages (vm.nr_hugepages or a pod's hugepages-2Mi; falls back to ordinary pages, logged)", "false",
           ("tiers", "cpu", "huge_pages"), switch=True),
    Option("--disk", "TIERKV_DISK", "disk tier PATH[:SIZE] (an lmdb directory)",
           "$TIERKV_CACHE_DIR/disk:10Gi when no tier is configured", split=_disk),
    Option("--s3", "TIERKV_S3", "s3 tier s3://bucket/prefix", "none", ("tiers", "s3", "url")),
    Option("--s3-endpoint", "TIERKV_S3_ENDPOINT", "S3 endpoint URL (SeaweedFS, MinIO)", "$AWS_ENDPOINT_URL, else AWS",
           ("tiers", "s3", "endpoint")),
    Option("--s3-capacity", "TIERKV_S3_CAPACITY", "bytes this node may write to the s3 tier", "1Ti",
           ("tiers", "s3", "capacity_bytes")),
    Option("--s3-admit-hits", "TIERKV_S3_ADMIT_HITS", "spill to s3 only blocks hit >= N times", "0",
           ("tiers", "s3", "admit_min_hits")),
    Option("--redis", "TIERKV_REDIS", "redis tier redis://[:password@]host:port/db", "none", ("tiers", "redis", "url")),
    Option("--redis-cluster", "TIERKV_REDIS_CLUSTER", "use Redis Cluster", "false", ("tiers", "redis", "cluster"),
           switch=True),
    Option("--redis-capacity", "TIERKV_REDIS_CAPACITY", "bytes this node may write to the redis tier", "4Gi",
           ("tiers", "redis", "capacity_bytes")),
    Option("--redis-password-file", "TIERKV_REDIS_PASSWORD_FILE", "file holding the Redis password (AUTH), so "
           "that it is in no url", "none", ("tiers", "redis", "password_file")),
    Option("--redis-tls-ca", "TIERKV_REDIS_TLS_CA", "PEM CA of a rediss:// server's certificate", "the system's CAs",
           ("tiers", "redis", "tls_ca")),
    Option("--s3-access-key-id-file", "TIERKV_S3_ACCESS_KEY_ID_FILE", "file holding the S3 access key id",
           "$AWS_ACCESS_KEY_ID", ("tiers", "s3", "access_key_id_file")),
    Option("--s3-secret-access-key-file", "TIERKV_S3_SECRET_ACCESS_KEY_FILE", "file holding the S3 secret key",
           "$AWS_SECRET_ACCESS_KEY", ("tiers", "s3", "secret_access_key_file")),
    Option("--s3-tls-ca", "TIERKV_S3_TLS_CA", "PEM CA bundle of an https S3 endpoint", "botocore's bundle",
           ("tiers", "s3", "tls_ca")),
    Option("--eviction", "TIERKV_EVICTION", "eviction policy of every tier (lru, s3fifo, arc)", "lru",
           ("tiers", "*", "eviction")),
    _scalar("--listen", "listen", "HOST:PORT to serve gRPC on", "127.0.0.1:50551"),
    _scalar("--metrics-port", "metrics_port", "serve Prometheus /metrics on 127.0.0.1:N (0 = off)", "0"),
    _scalar("--metrics-listen", "metrics_listen", "serve Prometheus /metrics on HOST:PORT (e.g. 0.0.0.0:9400)",
            "off"),
    _scalar("--shm-max-bytes", "shm_max_bytes", "shared memory all clients may map", "4Gi"),
    _scalar("--shm-socket", "shm_socket", "unix socket same-host clients hand their shared-memory segments over "
            "on (clients must see it at the same path)", "<runtime dir>/shm-<port>.sock"),
    _scalar("--stats-interval", "stats_interval_s", "log a one-line stats summary every N seconds (0 = off)", "60"),
    _scalar("--tenant-quota", "tenant_quota_bytes", "bytes each tenant may hold in the top tier, e.g. 512Mi; a "
            "tenant over it has its own oldest blocks spilled down (0 = no quota)", "0"),
    _scalar("--no-promote", "promote_on_hit", "do not promote blocks to faster tiers on a hit", "promote",
            switch=False),
    _scalar("--no-shm", "shm", "disable the shared-memory path", "enabled", switch=False),
    _scalar("--no-shm-arena", "shm_arena", "do not let same-host clients map the cpu tier read-only (the daemon "
            "then copies each Get into the client's segment)", "enabled", switch=False),
    _scalar("--no-stream", "stream", "disable the raw TCP Get channel", "enabled", switch=False),
    _scalar("--stream-port", "stream_port", "port of the raw TCP Get channel", "0 = any free port"),
    _scalar("--token-file", "token_file", "file holding the bearer token clients must send, created 0600 when "
            "missing; or the token itself in TIERKV_TOKEN", "$TIERKV_CACHE_DIR or $XDG_RUNTIME_DIR/tierkv, /token"),
    _scalar("--credentials-file", "credentials_file", "YAML file of credentials: each token (or token_file) with "
            "the tenants it may read and write, or admin: true (kvstore/server/credentials.py); replaces the one "
            "token", "none: the one token is an admin credential"),
    _scalar("--no-auth", "auth", "accept calls without a token: UNSAFE beyond loopback (anyone reaching the port "
            "reads and writes the cache)", "auth on", switch=False),
    _scalar("--tls-cert", "tls_cert", "PEM certificate: serve gRPC over TLS (with --tls-key)", "plaintext"),
    _scalar("--tls-key", "tls_key", "PEM private key of --tls-cert", "none"),
    _scalar("--tls-client-ca", "tls_client_ca", "PEM CA: require client certificates it signed (mutual TLS)", "none"),
    _scalar("--traces-dir", "traces_dir", "the only directory `kvstore trace start` may write trace files in",
            "$TIERKV_CACHE_DIR/traces"),
    _scalar("--mac-secret-file", "mac_secret_file", "file holding the secret that signs every block written to "
            "Redis or S3: every daemon sharing those tiers needs the same one (only the default file is created, "
            "0600, when missing)", "$TIERKV_CACHE_DIR or $XDG_RUNTIME_DIR/tierkv, /mac_secret"),
    _scalar("--mac-previous-secret-files", "mac_previous_secret_files", "comma-separated files of earlier secrets: "
            "blocks they signed are still accepted, none is signed with them (rotation)", "none"),
)
CONFIG_ENV = "TIERKV_CONFIG"
_METAVARS = {"--cpu": "SIZE", "--disk": "PATH[:SIZE]", "--s3": "URL", "--s3-endpoint": "URL", "--s3-capacity": "SIZE",
             "--s3-admit-hits": "N", "--redis": "URL", "--redis-capacity": "SIZE", "--eviction": "POLICY",
             "--listen": "HOST:PORT", "--metrics-port": "PORT", "--metrics-listen": "HOST:PORT",
             "--shm-max-bytes": "SIZE", "--shm-socket": "PATH", "--stats-interval": "SECONDS", "--tenant-quota": "SIZE",
             "--stream-port": "PORT", "--token-file": "FILE", "--credentials-file": "FILE", "--tls-cert": "FILE",
             "--tls-key": "FILE", "--tls-client-ca": "FILE", "--redis-password-file": "FILE", "--redis-tls-ca": "FILE",
             "--s3-access-key-id-file": "FILE", "--s3-secret-access-key-file": "FILE", "--s3-tls-ca": "FILE",
             "--mac-secret-file": "FILE", "--mac-previous-secret-files": "FILES", "--traces-dir": "DIR"}


def build_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The serve flags on ``parser`` (a new one if None). Unset flags stay None: they override nothing."""
    p = parser or argparse.ArgumentParser(prog="kvstore serve")
    p.add_argument("--config", metavar="FILE", help=f"YAML config file (default: none; env {CONFIG_ENV})")
    for o in OPTIONS:
        text = f"{o.help} (default: {o.default}; env {o.env})"
        if o.switch is not None:
            p.add_argument(o.flag, dest=o.dest, action="store_true", default=None, help=text)
        else:
            p.add_argument(o.flag, dest=o.dest, metavar=_METAVARS.get(o.flag, "VALUE"), help=text)
    p.add_argument("--check-config", action="store_true", help="validate the configuration, print it, and exit")
    return p


def flag_values(args: argparse.Namespace) -> Iterator[tuple[Option, dict[Path, Any]]]:
    """The flags given on the command line, as (option, {path: value})."""
    for o in OPTIONS:
        raw = getattr(args, o.dest, None)
        if raw is None:
            continue
        yield o, ({o.target: o.switch} if o.switch is not None else o.values(raw))


def tier_env_values(env: dict[str, str]) -> Iterator[tuple[Option, dict[Path, Any]]]:
    """The tier options set through their variables (a scalar's variable is read with its field's)."""
    for o in OPTIONS:
        if (o.target[:1] == ("tiers",) or o.split is not None) and (raw := env.get(o.env)) is not None:
            yield o, ({o.target: raw} if o.switch is not None else o.values(raw))
