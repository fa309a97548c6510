"""Who may call the daemon: a bearer token on every gRPC call, optionally over (mutual) TLS.

Server side: ``AuthInterceptor`` checks ``authorization: Bearer <token>`` before any handler
runs; a missing or unknown token is answered UNAUTHENTICATED, counted, and the handler is never
invoked. ``grpc.health.v1.Health`` is exempt: it says SERVING or not and nothing else, and
Kubernetes gRPC probes cannot send metadata. Which keys an authenticated call may touch is its
credential's (kvstore/server/credentials.py: a credentials file maps tokens to tenants, checked on
every key by the servicer and the raw Get channel, whose single-use tokens are bound to the
credential of the ``OpenStream`` call that issued them). Without a credentials file the one token
below is an admin credential.

Where the token comes from, daemon and client alike (first found wins): ``TIERKV_TOKEN``, the
file ``TIERKV_TOKEN_FILE`` / ``--token-file``, else the default file ``<runtime dir>/token``
(``$TIERKV_CACHE_DIR``, else ``$XDG_RUNTIME_DIR/tierkv``, else ``~/.cache/tierkv``), which a
daemon creates (0600, random) when it is missing. So a daemon and an engine of the same user on
one machine agree with no flag; a remote engine is given the token by env or file.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from kvstore.errors import KVStoreError
from kvstore.server.credentials import Access, CredentialTable, bearer, load_credentials
from tiers.errors import ConfigError

log = logging.getLogger(__name__)
HEALTH_PREFIX = "/grpc.health.v1.Health/"
MIN_TOKEN_CHARS = 16


class AuthError(KVStoreError):
    """The daemon refused the call's credentials (gRPC UNAUTHENTICATED). Not retried."""


# -- where tokens live ---------------------------------------------------------------------
def runtime_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("TIERKV_CACHE_DIR"):
        return Path(env["TIERKV_CACHE_DIR"])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "tierkv"
    return Path.home() / ".cache" / "tierkv"


def default_token_file(env: Mapping[str, str] | None = None) -> Path:
    return runtime_dir(env) / "token"


def check_token(token: str, source: str) -> str:
    """The token itself, or a ConfigError naming its source (never its value)."""
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"token from {source} is too short ({len(token)} chars, at least {MIN_TOKEN_CHARS})")
    if not token.isascii() or not token.isprintable() or any(c.isspace() for c in token):
        raise ConfigError(f"token from {source} must be printable ASCII without spaces")
    return token


def read_token_file(path: str | Path) -> str:
    try:
        text = Path(path).read_text(encoding="ascii", errors="replace")
    except OSError as e:
        raise ConfigError(f"cannot read token file {path}: {e.strerror or e}") from None
    return check_token(text.strip(), f"file {path}")


def ensure_token_file(path: str | Path) -> str:
    """Read ``path``, or create it first (0600, a fresh random token); safe when several daemons
    start at once: the file is linked into place complete, and whoever loses the race reads it."""
    path = Path(path)
    if not path.exists():
        try:
            _create_token_file(path)
        except OSError as e:
            raise ConfigError(f"cannot create token file {path}: {e.strerror or e}") from None
    return read_token_file(path)


def _create_token_file(path: Path) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        try:
            os.link(tmp, path)
            log.info("generated a new kvstore token in %s (0600)", path)
        except FileExistsError:
            pass  # another daemon won the race: use its token
    finally:
        tmp.unlink(missing_ok=True)


# -- configuration (fields live on StoreConfig; checked and described here) -----------------
def validate(cfg: Any) -> None:
    """Auth/TLS fields of a StoreConfig: one clear line per mistake."""
    if cfg.token:
        check_token(cfg.token, "TIERKV_TOKEN/config")
    if cfg.credentials_file:
        if not cfg.auth:
            raise ConfigError("credentials_file needs auth: drop --no-auth (TIERKV_AUTH=false)")
        if cfg.token or cfg.token_file:
            raise ConfigError("credentials_file lists every token: put the admin token in it (admin: true) and unset "
                              "token/token_file (TIERKV_TOKEN, TIERKV_TOKEN_FILE, --token-file)")
        load_credentials(cfg.credentials_file)
    if bool(cfg.tls_cert) != bool(cfg.tls_key):
        raise ConfigError("tls_cert and tls_key go together (--tls-cert and --tls-key)")
    if cfg.tls_client_ca and not cfg.tls_cert:
        raise ConfigError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
    for name in ("tls_cert", "tls_key", "tls_client_ca"):
        if (p := getattr(cfg, name)) and not os.access(p, os.R_OK):
            raise ConfigError(f"{name}: cannot read {p}")


def describe(cfg: Any) -> list[str]:
    """--check-config lines; the token's value never appears."""
    if not cfg.auth:
        lines = ["auth: OFF (--no-auth): anyone who reaches the port reads and writes the cache"]
    elif cfg.credentials_file:
        table = load_credentials(cfg.credentials_file)
        lines = [f"auth: {len(table)} credentials in {cfg.credentials_file} (tokens hidden), tenants: "
                 f"{', '.join(table.tenants) or 'none (admin only)'}"]
    elif cfg.token:
        lines = ["auth: bearer token from TIERKV_TOKEN/config (value hidden)"]
    else:
        path = cfg.token_file or default_token_file()
        lines = [f"auth: bearer token in {path} (created 0600 if missing)"]
    if cfg.tls_cert:
        mtls = f"; client certificates required (CA {cfg.tls_client_ca})" if cfg.tls_client_ca else ""
        lines.append(f"tls: cert {cfg.tls_cert}{mtls}; raw Get channel over TLS too (same certificate)")
    return lines


def server_token(cfg: Any) -> str | None:
    """The token the daemon requires (None with auth off), creating the default file if needed."""
    if not cfg.auth:
        return None
    if cfg.token:
        return cfg.token
    return ensure_token_file(cfg.token_file or default_token_file())


def server_access(cfg: Any) -> Access:
    """Who may call: the credentials file's table, else the one token as an admin, else (auth off) anyone."""
    if not cfg.auth:
        return Access(None)
    if cfg.credentials_file:
        return Access(load_credentials(cfg.credentials_file))
    return Access(CredentialTable.single(server_token(cfg)))  # type: ignore[arg-type]


def server_credentials(cfg: Any) -> grpc.ServerCredentials | None:
    if not cfg.tls_cert:
        return None
    pair = (Path(cfg.tls_key).read_bytes(), Path(cfg.tls_cert).read_bytes())
    ca = Path(cfg.tls_client_ca).read_bytes() if cfg.tls_client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


# -- server: the check before every handler -------------------------------------------------
class AuthInterceptor(grpc.ServerInterceptor):
    def __init__(self, access: Access, refused: Callable[[str], None]) -> None:
        self._access = access
        self._refused = refused

    def _fault(self, metadata: Any) -> str | None:
        if bearer(metadata) is None:
            return "missing"
        return None if self._access.caller(metadata) is not None else "wrong"

    def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith(HEALTH_PREFIX):
            return continuation(details)
        fault = self._fault(details.invocation_metadata)
        if fault is None:
            return continuation(details)
        handler = continuation(details)  # only to learn the call's shape; never invoked
        if handler is None:
            return None
        self._refused(fault)
        return _refusal(handler, f"{fault} bearer token (set TIERKV_TOKEN or TIERKV_TOKEN_FILE)")


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


# -- client: credentials and the channel that carries them ----------------------------------
@dataclass(frozen=True)
class ClientAuth:
    """What a client presents: a token (metadata on every call) and optional TLS files."""

    token: str = field(default="", repr=False)
    tls_ca: str = ""  # CA that signed the daemon's certificate; set (or cert) = TLS
    tls_cert: str = ""  # client certificate for mutual TLS
    tls_key: str = ""

    def __repr__(self) -> str:
        tls = f", tls_ca={self.tls_ca!r}, tls_cert={self.tls_cert!r}" if self.tls_ca or self.tls_cert else ""
        return f"ClientAuth(token={'<set>' if self.token else '<none>'}{tls})"

    @staticmethod
    def from_env(env: Mapping[str, str] | None = None, token_file: str = "", tls_ca: str = "",
                 tls_cert: str = "", tls_key: str = "", with_token: bool = True) -> ClientAuth:  # fmt: skip
        """The token from ``token_file`` if given, else TIERKV_TOKEN, else the file
        TIERKV_TOKEN_FILE, else the default token file if it exists (else none); TLS files from
        the arguments, else TIERKV_TLS_CA / TIERKV_CLIENT_CERT / TIERKV_CLIENT_KEY.
        ``with_token=False``: TLS only (for the health service, which needs no token)."""
        env = os.environ if env is None else env
        if not with_token:
            token = ""
        elif token_file:
            token = read_token_file(token_file)
        elif env.get("TIERKV_TOKEN"):
            token = check_token(env["TIERKV_TOKEN"], "TIERKV_TOKEN")
        elif env.get("TIERKV_TOKEN_FILE"):
            token = read_token_file(env["TIERKV_TOKEN_FILE"])
        else:
            default = default_token_file(env)
            token = read_token_file(default) if default.exists() else ""
        return ClientAuth(token, tls_ca or env.get("TIERKV_TLS_CA", ""),
                          tls_cert or env.get("TIERKV_CLIENT_CERT", ""), tls_key or env.get("TIERKV_CLIENT_KEY", ""))

    def channel(self, address: str, options: list[tuple[str, Any]]) -> grpc.Channel:
        if self.tls_ca or self.tls_cert:
            try:
                ca, key, cert = (Path(p).read_bytes() if p else None for p in (self.tls_ca, self.tls_key, self.tls_cert))
            except OSError as e:
                raise ConfigError(f"cannot read TLS file {e.filename}: {e.strerror}") from None
            creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
            ch = grpc.secure_channel(address, creds, options=options)
        else:
            ch = grpc.insecure_channel(address, options=options)
        return grpc.intercept_channel(ch, _Bearer(self.token)) if self.token else ch


class _Details(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


class _CallDetails(_Details, grpc.ClientCallDetails):
    pass


class _Bearer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
              grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):  # fmt: skip
    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def __repr__(self) -> str:
        return "_Bearer(<token>)"

    def _with_token(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        md = [*(d.metadata or ()), self._header]
        return _CallDetails(d.method, d.timeout, md, d.credentials, getattr(d, "wait_for_ready", None),
                            getattr(d, "compression", None))  # fmt: skip

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._with_token(details), requests)
