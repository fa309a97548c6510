"""The raw Get channel under TLS (kvstore/server/stream_tls.py): with the daemon's gRPC on TLS the
raw channel is TLS too, with the same certificate; a TLS client gets its blocks over it, nothing
readable reaches a client that speaks plaintext to it, and the client checks the daemon's
certificate (and, for mutual TLS, the daemon checks the client's) as gRPC does. Certificates are
made here by the openssl CLI; the daemons and sockets are real."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvstore.block import encode_block
from kvstore.client.client import KVStoreClient
from kvstore.client.retry import Retry
from kvstore.client.stream_client import StreamChannel
from kvstore.config.store_config import StoreConfig, TierConfig
from kvstore.errors import InvalidRequest, KVStoreUnavailable
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.server import stream_tls
from kvstore.server import stream_wire as w
from kvstore.server.auth import ClientAuth
from kvstore.server.daemon import Daemon
from tests.fixtures_kvstore import connect, fetch
from tests.kvstore.support import TOKEN

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
PAYLOAD = np.full(64 * 1024, 0x5A, np.uint8)  # what an eavesdropper would look for: 64 KiB of 'Z'
KEYS = [b"stream-tls-key-%02d" % i for i in range(6)]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "rogue-ca"):
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.pem",
                 "-days", "1", "-subj", f"/CN={ca}", cwd=d)  # fmt: skip
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"), ("client", "extendedKeyUsage=clientAuth")):
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    return d


@pytest.fixture(params=[False, True], ids=["tls", "mtls"])
def tls_daemon(request: pytest.FixtureRequest, pki: Path) -> Iterator[Daemon]:
    cfg = StoreConfig(tiers=(TierConfig("cpu", 16 << 20),), listen="127.0.0.1:0", token=TOKEN,
                      tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"),
                      tls_client_ca=str(pki / "ca.pem") if request.param else "")  # fmt: skip
    d = Daemon(cfg)
    d.start()
    yield d
    d.stop()


def _good(pki: Path) -> ClientAuth:
    return ClientAuth(TOKEN, str(pki / "ca.pem"), str(pki / "client.pem"), str(pki / "client.key"))


def _block(key: bytes) -> bytes:
    return encode_block(key, PAYLOAD)


def _client(d: Daemon, auth: ClientAuth) -> KVStoreClient:
    return connect(d, deadline_s=10.0, retry=Retry(attempts=1), use_shm=False, use_stream=True, auth=auth)


def _grant(d: Daemon, auth: ClientAuth) -> tuple[int, bytes]:
    """An OpenStream grant, asked over gRPC (TLS) as a client would."""
    ch = auth.channel(d.address, [])
    try:
        resp = pb_grpc.KVStoreStub(ch).OpenStream(pb.OpenStreamRequest(), timeout=10)
    finally:
        ch.close()
    assert resp.ok, resp.reason  # under TLS the raw channel is open, not refused
    return resp.port, resp.token


def _stored(d: Daemon, pki: Path) -> None:
    with _client(d, _good(pki)) as c:
        assert c.put_many([(k, _block(k)) for k in KEYS]) == [True] * len(KEYS)


def test_a_tls_client_gets_its_blocks_over_the_tls_raw_channel(tls_daemon: Daemon, pki: Path) -> None:
    _stored(tls_daemon, pki)
    with _client(tls_daemon, _good(pki)) as c:
        assert fetch(c, KEYS) == [_block(k) for k in KEYS]
        (conn,) = c._stream._idle  # the raw channel carried them (use_stream=True: no gRPC fallback), over TLS
        assert isinstance(conn, ssl.SSLSocket) and conn.version() in ("TLSv1.2", "TLSv1.3")
        assert fetch(c, KEYS) == [_block(k) for k in KEYS]
        assert c._stream._idle == [conn]  # reused: nothing was left unread on it between calls


def test_nothing_readable_reaches_a_plaintext_client(tls_daemon: Daemon, pki: Path) -> None:
    _stored(tls_daemon, pki)
    port, token = _grant(tls_daemon, _good(pki))
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            s.sendall(token + w.encode_request(KEYS))  # the old plaintext protocol, with a valid token
            while chunk := s.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass  # refused outright
        except TimeoutError:
            pass  # the daemon kept the connection open, waiting for more: a plaintext channel (asserted below)
    assert bytes(PAYLOAD[:64]) not in got  # no block: nothing of it, in any framing
    assert not got.startswith(w.FRAME.pack(w.FOUND, len(_block(KEYS[0]))))
    assert got == b"" or got[0] == 0x15  # closed, at most with a TLS alert record
    # the grant was never spent in plaintext: the daemon read no token, and a TLS client still gets its blocks
    with _client(tls_daemon, _good(pki)) as c:
        assert fetch(c, KEYS[:2]) == [_block(k) for k in KEYS[:2]]


def test_the_client_checks_the_daemons_certificate_on_the_raw_channel(tls_daemon: Daemon, pki: Path) -> None:
    _stored(tls_daemon, pki)
    good = _good(pki)
    rogue = stream_tls.client_context(str(pki / "rogue-ca.pem"), good.tls_cert, good.tls_key)  # trusts another CA
    ch = StreamChannel("127.0.0.1", lambda: _grant(tls_daemon, good), 1 << 20, tls=rogue)
    with pytest.raises(KVStoreUnavailable, match="certificate"):
        ch.get(KEYS[:1], lambda i, mv: None, timeout=10)
    ok = StreamChannel("127.0.0.1", lambda: _grant(tls_daemon, good), 1 << 20,
                       tls=stream_tls.client_context(good.tls_ca, good.tls_cert, good.tls_key))
    got: list[bytes] = []
    assert ok.get(KEYS[:1], lambda i, mv: got.append(bytes(mv)), timeout=10) and got == [_block(KEYS[0])]
    ok.close()


def test_a_refusal_reaches_a_tls_client_as_its_typed_error(tls_daemon: Daemon, pki: Path) -> None:
    good = _good(pki)
    ch = StreamChannel("127.0.0.1", lambda: _grant(tls_daemon, good), 1 << 20,
                       tls=stream_tls.client_context(good.tls_ca, good.tls_cert, good.tls_key))
    too_many = [b"k%015d" % i for i in range(tls_daemon.cfg.max_keys_per_call + 1)]
    with pytest.raises(InvalidRequest, match="keys in one call"):  # the error frame, sent over TLS, then closed
        ch.get(too_many, lambda i, mv: None, timeout=10)
    got: list[bytes] = []
    _stored(tls_daemon, pki)
    assert ch.get(KEYS[:1], lambda i, mv: got.append(bytes(mv)), timeout=10) and got == [_block(KEYS[0])]
    ch.close()


def test_mutual_tls_on_the_raw_channel_needs_a_client_certificate(pki: Path) -> None:
    cfg = StoreConfig(tiers=(TierConfig("cpu", 16 << 20),), listen="127.0.0.1:0", token=TOKEN,
                      tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"),
                      tls_client_ca=str(pki / "ca.pem"))  # fmt: skip
    d = Daemon(cfg)
    d.start()
    try:
        _stored(d, pki)
        no_cert = StreamChannel("127.0.0.1", lambda: _grant(d, _good(pki)), 1 << 20,
                                tls=stream_tls.client_context(str(pki / "ca.pem")))
        with pytest.raises(KVStoreUnavailable):  # TLS 1.3: the refusal may surface at the first read
            no_cert.get(KEYS[:1], lambda i, mv: pytest.fail("a block without a client certificate"), timeout=10)
    finally:
        d.stop()


def test_a_daemon_without_tls_keeps_a_plaintext_raw_channel() -> None:
    d = Daemon(StoreConfig(tiers=(TierConfig("cpu", 16 << 20),), listen="127.0.0.1:0", token=TOKEN))
    d.start()
    try:
        assert d.streams is not None and d.streams.tls is None
        auth = ClientAuth(TOKEN)
        assert stream_tls.client_context(auth.tls_ca, auth.tls_cert, auth.tls_key) is None
        with _client(d, auth) as c:
            assert c.put(KEYS[0], _block(KEYS[0])) and fetch(c, KEYS[:1]) == [_block(KEYS[0])]
    finally:
        d.stop()
