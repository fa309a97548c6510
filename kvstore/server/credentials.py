"""Credentials: which tenants each bearer token may touch, and the one check of every key.

A tenant is a credential, never a field the client fills in. The daemon's credentials file (YAML,
``--credentials-file`` / ``TIERKV_CREDENTIALS_FILE``; mountable from a Kubernetes Secret) lists
each token with what it may do::

    credentials:
      - token_file: /run/secrets/acme      # or token: "..."; tokens >= 16 chars, never logged
        tenants: [acme]                    # the namespaces this credential reads and writes
      - token_file: /run/secrets/engines
        tenants: [acme, globex]            # an engine serving two tenants
      - token_file: /run/secrets/ops
        admin: true                        # every namespace, writes the shared one, all Stats, traces

A relative ``token_file`` is relative to the credentials file. Without a credentials file the one
bearer token (kvstore/server/auth.py) is a single admin credential, as before.

``Caller`` is what one call may do. ``Caller.may_read(key)`` / ``may_write(key)`` is the one
rule, applied by every path that names keys (gRPC Lookup/Get/GetShm/Put/Delete, the raw Get
channel, shared memory; kvstore/server/servicer.py, stream_server.py):

- a key tagged with a tenant (kvstore/keys.py, ``tag = tenant_tag(name)``): only credentials listing
  that tenant (and admin);
- a key of the shared namespace: read by every credential, written and deleted by admin only;
- an untagged key (16 bytes, or any opaque key): admin, or a credential listing tenant ``default``.

The tenant of a key is ``tenant_of`` (kvstore/store/tenants.py), the same function that charges its
bytes, so what a credential may write is exactly what is charged to its tenants: its quota holds
whatever salts its requests use. Tags of configured tenants must differ (a config where two collide
is refused), so no credential's keys are another tenant's.

Shared memory asks the same ``Caller``. The cpu tier's arena holds every tenant's blocks, each with
its key in its header, so only a caller that may read every key (``Caller.sees_all``: admin, or the
one credential of a daemon without a credentials file) is handed the arena's fd and answered in
place; a tenant's shared-memory Gets are checked like any Get and copied into its own segment. A
session belongs to the credential that attached it (``Caller.credential``, its token's digest): a
call made with another token finds no such session, whatever tenants the two share.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvstore.errors import PermissionDenied
from kvstore.keys import DEFAULT_TENANT, check_tenant_name
from kvstore.store.tenants import DEFAULT, SHARED, name_of_tenant, tenant_of
from tiers.errors import ConfigError

_ENTRY_KEYS = frozenset({"token", "token_file", "tenants", "admin"})


@dataclass(frozen=True)
class Caller:
    """What one authenticated call may do: derived from its credential, never from the request."""

    label: str  # how messages and logs name the credential ("admin", "credentials[2]"); never the token
    admin: bool = False
    tenants: tuple[str, ...] = ()  # configured tenant names
    # which credential this is: its token's SHA-256 (set by CredentialTable; b"" for the one caller of
    # a daemon without auth). What shared-memory sessions are bound to; never compared as a permission
    credential: bytes = field(default=b"", repr=False, compare=False)
    names: frozenset[str] = field(init=False, repr=False)  # their ``tenant_of`` names

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", frozenset(name_of_tenant(t) for t in self.tenants))

    @property
    def sees_all(self) -> bool:
        """May this caller read every key? Only such a caller maps the cpu arena (every tenant's blocks)."""
        return self.admin

    def may_read(self, key: bytes) -> bool:
        """May this caller look up or read ``key``?"""
        return self.sees_all or (t := tenant_of(key)) in self.names or t == SHARED

    def may_write(self, key: bytes) -> bool:
        """May this caller store or delete ``key``?"""
        return self.admin or tenant_of(key) in self.names

    def refusal(self, keys: Sequence[bytes], write: bool) -> str | None:
        """Why the first key this caller may not read (``write``: write) is refused; None if none is.
        The message names neither the key's tenant nor any tenant but the caller's own."""
        may = self.may_write if write else self.may_read
        for i, k in enumerate(keys):
            if may(k):
                continue
            t = tenant_of(k)
            if t == SHARED:
                return f"key {i} is in the shared namespace, which only an admin credential writes"
            if t == DEFAULT:
                return f"key {i} is untagged (tenant {DEFAULT_TENANT!r}), which {self.label} does not list"
            mine = ", ".join(self.tenants) or "none"
            return f"key {i} is outside the tenants of {self.label} ({mine})"
        return None

    def check(self, keys: Sequence[bytes], write: bool = False) -> None:
        """Raise PermissionDenied (one line) unless this caller may read (``write``: write) every key."""
        if (why := self.refusal(keys, write)) is not None:
            raise PermissionDenied(f"permission denied: {why}")

    def check_admin(self, what: str) -> None:
        if not self.admin:
            raise PermissionDenied(f"permission denied: {what} needs an admin credential ({self.label} is not)")


ADMIN = Caller("admin", admin=True)


def _digest(token: str | bytes) -> bytes:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).digest()


class CredentialTable:
    """Token -> Caller. Tokens are kept only as SHA-256 digests: a lookup compares digests (which
    leak nothing of a token by their timing), and no token sits in memory to be logged or dumped."""

    def __init__(self, entries: Iterable[tuple[str, Caller]], source: str = "") -> None:
        self.source = source
        self._by_digest: dict[bytes, Caller] = {}
        for token, caller in entries:
            d = _digest(token)
            if d in self._by_digest:
                raise ConfigError(f"{source}: {caller.label} has the same token as {self._by_digest[d].label}")
            self._by_digest[d] = replace(caller, credential=d)
        if not self._by_digest:
            raise ConfigError(f"{source}: no credentials")
        tenants = sorted({t for c in self._by_digest.values() for t in c.tenants})
        self.tenants = tuple(tenants)
        shown: dict[str, str] = {}
        for t in tenants:  # two names with one tag would share every key: refuse
            n = name_of_tenant(t)
            if n in shown:
                raise ConfigError(f"{source}: tenants {shown[n]!r} and {t!r} have the same tag ({n}): rename one")
            shown[n] = t
        self._display = shown  # tenant_of name -> configured name

    @staticmethod
    def single(token: str) -> CredentialTable:
        """The one bearer token of a deployment without a credentials file: an admin credential."""
        return CredentialTable([(token, ADMIN)], "token")

    def caller(self, token: str | bytes) -> Caller | None:
        return self._by_digest.get(_digest(token))

    def caller_of_digest(self, digest: bytes) -> Caller | None:
        return self._by_digest.get(digest)

    def display(self, name: str) -> str:
        """A Stats row's tenant as an operator knows it: the configured name of a tenant's tag."""
        return self._display.get(name, name)

    def __len__(self) -> int:
        return len(self._by_digest)

    def __repr__(self) -> str:
        return f"CredentialTable({len(self)} credentials from {self.source or '?'}, tenants {list(self.tenants)})"


class Access:
    """The daemon's credentials as they are now (None: auth off, every caller is admin), and the
    caller of a call from its metadata. ``table`` is replaced whole by a reload, never edited."""

    def __init__(self, table: CredentialTable | None) -> None:
        self.table = table

    def caller(self, metadata: Any) -> Caller | None:
        """The caller a call's ``authorization: Bearer TOKEN`` names; None: no such credential."""
        table = self.table
        if table is None:
            return ADMIN
        token = bearer(metadata)
        return None if token is None else table.caller(token)

    def display(self, name: str) -> str:
        return name if self.table is None else self.table.display(name)

    def binding(self, metadata: Any) -> Callable[[], Caller | None]:
        """The caller of this call's token *as of each later call*: a reload that drops or changes
        the credential applies to what was granted under it (a raw-channel connection) too."""
        token = bearer(metadata)
        digest = _digest(token) if token is not None else b""

        def current() -> Caller | None:
            table = self.table
            return ADMIN if table is None else table.caller_of_digest(digest)

        return current

    def reload(self, path: str | Path) -> CredentialTable:
        """Read ``path`` again and switch to it whole (ConfigError: the old table stays)."""
        table = load_credentials(path)
        self.table = table
        return table


def bearer(metadata: Any) -> bytes | None:
    """The token of a call's ``authorization: Bearer TOKEN`` (None: no such header)."""
    values = [v for k, v in (metadata or ()) if k == "authorization"]
    if not values:
        return None
    v = values[0].encode() if isinstance(values[0], str) else bytes(values[0])
    return v[len(b"Bearer "):] if v.startswith(b"Bearer ") else b""


def load_credentials(path: str | Path) -> CredentialTable:
    """Read and check a credentials file; ConfigError with one line per mistake (never a token)."""
    import yaml

    from kvstore.server.auth import check_token, read_token_file  # auth imports us: late

    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read credentials file {path}: {' '.join(str(e).split())}") from None
    if not isinstance(doc, Mapping) or set(doc) != {"credentials"} or not isinstance(doc["credentials"], list):
        raise ConfigError(f"{path}: expected one key, credentials: a list of {{token_file or token, tenants or admin}}")
    entries = []
    for i, raw in enumerate(doc["credentials"]):
        where = f"{path}: credentials[{i}]"
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: expected a mapping with token_file or token, and tenants or admin")
        if unknown := sorted(set(map(str, raw)) - _ENTRY_KEYS):
            raise ConfigError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(_ENTRY_KEYS))})")
        entries.append((_token(raw, where, path.parent, check_token, read_token_file), _caller(raw, where, i)))
    return CredentialTable(entries, str(path))


def _token(raw: Mapping[str, Any], where: str, base: Path, check_token: Any, read_token_file: Any) -> str:
    if ("token" in raw) == ("token_file" in raw):
        raise ConfigError(f"{where}: give exactly one of token_file and token")
    if "token" in raw:
        if not isinstance(raw["token"], str):
            raise ConfigError(f"{where}.token must be a string")
        return str(check_token(raw["token"], f"{where}.token"))
    file = raw["token_file"]
    if not isinstance(file, str) or not file:
        raise ConfigError(f"{where}.token_file must be a path")
    return str(read_token_file(base / file))


def _caller(raw: Mapping[str, Any], where: str, i: int) -> Caller:
    admin = raw.get("admin", False)
    if not isinstance(admin, bool):
        raise ConfigError(f"{where}.admin must be true or false")
    tenants = raw.get("tenants", [])
    if not isinstance(tenants, list) or not all(isinstance(t, str) for t in tenants):
        raise ConfigError(f"{where}.tenants must be a list of tenant names")
    if admin and tenants:
        raise ConfigError(f"{where}: an admin credential covers every tenant; drop its tenants")
    if not admin and not tenants:
        raise ConfigError(f"{where}: list its tenants, or make it admin: true")
    for t in tenants:
        try:
            check_tenant_name(t, f"{where}.tenants")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return Caller(f"credentials[{i}]", admin=admin, tenants=tuple(dict.fromkeys(tenants)))
