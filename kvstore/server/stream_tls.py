"""TLS for the raw Get channel (kvstore/server/stream_server.py, kvstore/client/stream_client.py).

When the daemon serves gRPC over TLS, the raw channel is TLS too, with the same certificate and
key (and, for mutual TLS, the same client CA); a client that reaches gRPC over TLS reaches the raw
channel over TLS, checking the daemon's certificate against the same CA and host name as its gRPC
channel does, and presenting the same client certificate. Nothing of a block, a key or the
channel's token crosses in plaintext: a client that speaks plaintext to it fails the handshake
before it is read.

Handshakes run on each connection's own thread, bounded by the channel's handshake time, never
on the accept loop. A pooled client connection has nothing unread between calls (TLS 1.3 session
tickets come right after the handshake and are consumed with the first reply), so the client
still tells an idle connection the daemon closed (it becomes readable) from one it may reuse.
"""

from __future__ import annotations

import ssl
from typing import Any

from tiers.errors import ConfigError


def server_context(cert: str, key: str, client_ca: str = "") -> ssl.SSLContext:
    """The daemon's side: its certificate and key; with ``client_ca``, client certificates are
    required and checked against it (as gRPC's ``require_client_auth``)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
        if client_ca:
            ctx.load_verify_locations(cafile=client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"raw channel TLS: cannot load {cert} / {key} / {client_ca or '-'}: {e}") from None
    return ctx


def server_context_of(cfg: Any) -> ssl.SSLContext | None:
    """The raw channel's TLS for a daemon config: None when its gRPC is plaintext (no ``tls_cert``)."""
    return server_context(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca) if cfg.tls_cert else None


def client_context(tls_ca: str = "", tls_cert: str = "", tls_key: str = "") -> ssl.SSLContext | None:
    """The client's side, from the files its gRPC channel uses (kvstore/server/auth.py ClientAuth):
    None when that channel is plaintext (neither a CA nor a client certificate). The daemon's
    certificate is checked against ``tls_ca`` (the system's CAs without one) and its host name,
    as gRPC checks it."""
    if not (tls_ca or tls_cert):
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls_ca or None)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls_cert:
        ctx.load_cert_chain(tls_cert, tls_key or None)
    return ctx
