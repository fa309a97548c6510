"""Tenants of an engine: API keys that name them, and the cache scope a request of a tenant gets.

A request's tenant comes from the server, never from the request: the tenant of its API key
(``kvengine serve --api-keys FILE``, like vLLM's ``--api-key``: ``Authorization: Bearer KEY`` on
/v1/*), else the one tenant of the engine (``--tenant NAME``), else none (legacy: the body's
``cache_salt`` alone names the tenant, as before). The body's ``cache_salt`` then only sub-divides
that tenant's namespace.

The engine keeps one radix tree per ``Request.cache_salt`` and the connector keys pages by it, so
the server hands the engine a *scope*: ``scoped_salt(tenant, salt)``, an opaque string that no
body salt can spell (a body ``cache_salt`` with control characters is refused, and a scope starts
with one). Only the connector's key spaces open it again (``split_salt``), into the tenant (the
tag of its keys, which the daemon checks against the engine's credential) and the salt (digest
only). Strings appended to a scope (the quality gate's shadow trees) stay inside its salt.

Tenant names follow the daemon's rule (kvstore/keys.py ``check_tenant_name``; engine/ imports
nothing of kvstore): 1-64 letters, digits, ``.``, ``_``, ``-``, starting with a letter or digit.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from pathlib import Path

from engine.errors import ConfigError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_RESERVED = frozenset({"shared", "_other"})  # the daemon's Stats rows of its own
_MARK = "\x1e"  # starts a scope and ends its tenant: no tenant name or body salt contains it
MIN_KEY_CHARS = 16
#: what answers without an API key (probes, Prometheus): every other path needs one (deny by default)
OPEN_PATHS = frozenset({"/health", "/metrics"})
#: the one message of a 401, from the engine's server or its gate (engine/gate.py)
MISSING_KEY = "missing or invalid API key (send 'Authorization: Bearer KEY')"


def check_tenant(name: object, where: str = "tenant") -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in _RESERVED:
        raise ConfigError(f"{where}: {name!r} is not a tenant name (1-64 letters, digits, '.', '_', '-', starting "
                          f"with a letter or digit; not {' or '.join(sorted(_RESERVED))})")
    return name


def scoped_salt(tenant: str, salt: str | None) -> str | None:
    """The engine-side ``cache_salt`` of a request of ``tenant`` whose body says ``salt``."""
    if not tenant:
        return salt
    return f"{_MARK}{tenant}{_MARK}{salt or ''}"


def split_salt(scope: str | None) -> tuple[str, str]:
    """(tenant, salt) of an engine-side ``cache_salt`` (tenant "" for a legacy, unscoped one)."""
    if scope and scope.startswith(_MARK):
        tenant, sep, salt = scope[1:].partition(_MARK)
        if sep and _NAME.fullmatch(tenant):
            return tenant, salt
    return "", scope or ""


def body_salt_error(salt: str | None) -> str | None:
    """Why a request body's ``cache_salt`` is refused (None: it is fine): control characters are
    what scopes are made of, so a body salt with one could pass for another tenant's scope."""
    if salt and any(ord(c) < 0x20 or ord(c) == 0x7F for c in salt):
        return "cache_salt must not contain control characters"
    return None


class ApiKeys:
    """API key -> tenant, from a YAML mapping (``KEY: tenant``; keys of at least 16 printable
    characters). Keys are held as SHA-256 digests only: a lookup compares digests, whose timing
    tells nothing about a key, and no key sits in memory to be logged."""

    def __init__(self, mapping: Mapping[str, str], source: str = "") -> None:
        if not mapping:
            raise ConfigError(f"{source or 'api keys'}: no API keys")
        self._tenant_of: dict[bytes, str] = {}
        for i, (key, tenant) in enumerate(mapping.items()):
            where = f"{source or 'api keys'}: entry {i}"  # never the key itself
            if not isinstance(key, str) or len(key) < MIN_KEY_CHARS or not key.isascii() or not key.isprintable() \
                    or any(c.isspace() for c in key):
                raise ConfigError(f"{where}: an API key must be at least {MIN_KEY_CHARS} printable ASCII characters "
                                  "without spaces")
            self._tenant_of[_digest(key)] = check_tenant(tenant, f"{where}'s tenant")
        self.tenants = tuple(sorted(set(self._tenant_of.values())))

    @staticmethod
    def load(path: str | Path) -> ApiKeys:
        """ConfigError (one line, never a key) for an unreadable or malformed file."""
        import yaml

        try:
            doc = yaml.safe_load(Path(path).read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read API keys file {path}: {' '.join(str(e).split())}") from None
        if not isinstance(doc, Mapping):
            raise ConfigError(f"{path}: expected a mapping of API key -> tenant")
        return ApiKeys(doc, str(path))

    def tenant(self, authorization: str | None) -> str | None:
        """The tenant of an ``Authorization: Bearer KEY`` header; None: missing or unknown key."""
        if not authorization or not authorization.startswith("Bearer "):
            return None
        return self._tenant_of.get(_digest(authorization[len("Bearer "):].strip()))

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._tenant_of)} keys, tenants {list(self.tenants)})"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def served_tenants(tenant: str, api_keys_file: str) -> tuple[str, ...]:
    """The tenants an engine with these settings serves (none: a legacy engine)."""
    if tenant:
        return (tenant,)
    return ApiKeys.load(api_keys_file).tenants if api_keys_file else ()
