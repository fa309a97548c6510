"""The shared tiers' secrets: the MAC secrets that sign blocks in Redis and S3, the Redis password,
the S3 keys, and the CA files of their TLS endpoints. Checked with the config; read at start.

Why files: a secret given as a file comes from a Docker or Kubernetes secret without passing
through a command line (``ps``), a compose file or an image, and a deployment can be checked
(``--check-config``) without it. Each is read once, when the daemon builds its tiers; an
unreadable or empty file (or a MAC secret too short) stops the daemon with one line naming it.

The MAC secret (tiers/mac.py) follows the bearer token's rule (kvstore/server/auth.py): the
file ``mac_secret_file`` (``--mac-secret-file``, ``TIERKV_MAC_SECRET_FILE``), else the default
``<runtime dir>/mac_secret``, which is created 0600 with a random secret when missing (by auth's
own race-safe creation), so daemons of one user on one machine agree with no flag. A file named
explicitly is never created: a daemon that made up its own secret would refuse, and delete,
every block the rest of its cluster wrote. ``mac_previous_secret_files`` (comma-separated) are
accepted, never used to sign: the rotation of docs/operations.md.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tiers.errors import ConfigError
from tiers.mac import MIN_SECRET_CHARS, BlockMac

log = logging.getLogger(__name__)
SIGNED_KINDS = ("redis", "s3")  # tiers other nodes and programs can write: every block signed


def default_mac_secret_file() -> Path:
    from kvstore.server.auth import runtime_dir  # local: the store stays free of gRPC until a daemon starts

    return runtime_dir() / "mac_secret"


def previous_files(cfg: Any) -> list[str]:
    return [p.strip() for p in cfg.mac_previous_secret_files.split(",") if p.strip()]


def signs(cfg: Any) -> bool:
    """Whether the daemon has a tier whose blocks are signed."""
    return any(t.kind in SIGNED_KINDS for t in cfg.tiers)


# -- checked with the configuration ------------------------------------------------------------
def validate_tier(tc: Any) -> None:
    """One TierConfig's secret fields: each on the kind it belongs to; the Redis password given once."""
    if tc.password_file and tc.kind != "redis":
        raise ConfigError(f"{tc.kind}: password_file applies to the redis tier only")
    if tc.password_file and _url_password(tc.url):
        raise ConfigError("redis: the password is given twice (in the url and password_file): keep the file")
    for name in ("access_key_id", "secret_access_key"):  # a file wins over a value (AWS_* in the environment)
        if getattr(tc, f"{name}_file") and tc.kind != "s3":
            raise ConfigError(f"{tc.kind}: {name}_file applies to the s3 tier only")
    if tc.tls_ca and tc.kind == "redis" and not tc.url.startswith("rediss://"):
        raise ConfigError("redis: tls_ca needs a rediss:// url (TLS)")
    if tc.tls_ca and tc.kind == "s3" and tc.endpoint and not tc.endpoint.startswith("https://"):
        raise ConfigError("s3: tls_ca needs an https:// endpoint")
    if tc.tls_ca and tc.kind not in SIGNED_KINDS:
        raise ConfigError(f"{tc.kind}: tls_ca applies to the redis and s3 tiers only")


def _url_password(url: str) -> bool:
    try:
        return bool(urlsplit(url).password) or "password=" in urlsplit(url).query
    except ValueError:
        return False


def describe(cfg: Any) -> list[str]:
    """--check-config lines; never a secret's value."""
    if not signs(cfg):
        return []
    path = cfg.mac_secret_file or f"{default_mac_secret_file()} (created 0600 if missing)"
    previous = previous_files(cfg)
    lines = [f"shared tiers: blocks signed with the secret in {path}"
             + (f"; also accepted: {', '.join(previous)}" if previous else "")]
    for tc in cfg.tiers:
        files = [f"{n} from {getattr(tc, n + '_file')}" for n in ("password", "access_key_id", "secret_access_key")
                 if getattr(tc, n + "_file", "")]
        if tc.tls_ca:
            files.append(f"TLS CA {tc.tls_ca}")
        if files:
            lines.append(f"{tc.kind}: {'; '.join(files)}")
    return lines


# -- read at start ---------------------------------------------------------------------------
def read_secret(path: str | Path, what: str) -> str:
    """The stripped contents of a secret file, or a ConfigError naming it (never its value)."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace").strip()
    except OSError as e:
        raise ConfigError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    if not text:
        raise ConfigError(f"{what}: {path} is empty")
    return text


def _mac_secret(path: Path) -> bytes:
    secret = read_secret(path, "mac secret")
    if len(secret) < MIN_SECRET_CHARS:
        raise ConfigError(f"mac secret: {path} holds {len(secret)} characters, at least {MIN_SECRET_CHARS} needed "
                          f"(e.g. openssl rand -hex 32 > {path})")
    return secret.encode()


def block_mac(cfg: Any) -> BlockMac:
    """The MAC of the shared tiers, from the configured files (the default one created if missing)."""
    if cfg.mac_secret_file:
        path = Path(cfg.mac_secret_file)
    else:
        path = default_mac_secret_file()
        if not path.exists():
            from kvstore.server.auth import ensure_token_file

            ensure_token_file(path)  # auth's creation: 0600, random, safe when daemons start at once
            log.warning("shared tiers: blocks are signed with a new secret in %s; every daemon that shares these "
                        "tiers needs the same secret (--mac-secret-file), or it refuses this one's blocks", path)
    mac = BlockMac(_mac_secret(path), [_mac_secret(Path(p)) for p in previous_files(cfg)])
    log.info("shared tiers: blocks signed with secret %s (from %s); accepted: %s", mac.current_id, path, mac)
    return mac


def redis_password(tc: Any) -> str | None:
    return read_secret(tc.password_file, "redis password_file") if tc.password_file else None


def s3_keys(tc: Any) -> tuple[str | None, str | None]:
    """(access key id, secret access key): each from its file, else its value, else None (boto3's chain)."""
    out = []
    for name in ("access_key_id", "secret_access_key"):
        file = getattr(tc, f"{name}_file")
        out.append(read_secret(file, f"s3 {name}_file") if file else getattr(tc, name) or None)
    return out[0], out[1]
