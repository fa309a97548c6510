"""TLS and mutual TLS on loopback, with certificates made here by the openssl CLI."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.cli import main as cli_main
from kvstore.client.client import KVStoreClient
from kvstore.client.retry import Retry
from kvstore.config.store_config import StoreConfig, TierConfig
from kvstore.errors import KVStoreUnavailable
from kvstore.server.auth import AuthError, ClientAuth
from kvstore.server.daemon import Daemon
from tests.fixtures_kvstore import connect, fetch_one
from tests.kvstore.support import KEY, TOKEN, auth_block

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem",
             "-days", "1", "-subj", f"/CN={name}", cwd=d)  # fmt: skip


def _leaf(d: Path, name: str, ca: str, ext: str) -> None:
    (d / f"{name}.ext").write_text(ext + "\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
             "-subj", f"/CN={name}", cwd=d)  # fmt: skip
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=d)  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    _leaf(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost")
    _leaf(d, "client", "ca", "extendedKeyUsage=clientAuth")
    _leaf(d, "rogue", "rogue-ca", "extendedKeyUsage=clientAuth")
    return d


def _daemon(pki: Path, mtls: bool) -> Daemon:
    cfg = StoreConfig(tiers=(TierConfig("cpu", 16 << 20),), listen="127.0.0.1:0", token=TOKEN,
                      tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"),
                      tls_client_ca=str(pki / "ca.pem") if mtls else "")  # fmt: skip
    d = Daemon(cfg)
    d.start()
    return d


@pytest.fixture(params=[False, True], ids=["tls", "mtls"])
def tls_daemon(request: pytest.FixtureRequest, pki: Path) -> Iterator[Daemon]:
    d = _daemon(pki, request.param)
    yield d
    d.stop()


def _client(d: Daemon, auth: ClientAuth) -> KVStoreClient:
    return connect(d, deadline_s=10.0, retry=Retry(attempts=1), use_shm=False, auth=auth)


def test_tls_round_trip_and_refusals(tls_daemon: Daemon, pki: Path) -> None:
    mtls = bool(tls_daemon.cfg.tls_client_ca)
    assert tls_daemon.streams is not None and tls_daemon.streams.tls is not None  # the raw channel is TLS too
    good = ClientAuth(TOKEN, str(pki / "ca.pem"), str(pki / "client.pem"), str(pki / "client.key"))
    with _client(tls_daemon, good) as c:
        assert c.put(KEY, auth_block())
        assert fetch_one(c, KEY) == auth_block()
    with _client(tls_daemon, ClientAuth(TOKEN)) as plain, pytest.raises(KVStoreUnavailable):
        plain.lookup([KEY])  # plaintext to a TLS port
    with _client(tls_daemon, ClientAuth("", good.tls_ca, good.tls_cert, good.tls_key)) as anon:
        with pytest.raises(AuthError):  # TLS does not replace the token
            anon.lookup([KEY])
    no_cert = ClientAuth(TOKEN, str(pki / "ca.pem"))
    rogue = ClientAuth(TOKEN, str(pki / "ca.pem"), str(pki / "rogue.pem"), str(pki / "rogue.key"))
    for auth in (no_cert, rogue):
        with _client(tls_daemon, auth) as c:
            if mtls:
                with pytest.raises(KVStoreUnavailable):
                    c.lookup([KEY])
            else:  # plain TLS: any client that trusts the server's CA may try (the token decides)
                assert c.lookup([KEY]).prefix_len == 1


def test_health_over_mtls(pki: Path) -> None:
    d = _daemon(pki, mtls=True)
    try:
        flags = ["--address", d.address, "--tls-ca", str(pki / "ca.pem"), "--deadline", "10"]
        client = ["--tls-cert", str(pki / "client.pem"), "--tls-key", str(pki / "client.key")]
        assert cli_main(["health", *flags, *client]) == 0
        assert cli_main(["health", *flags]) == 1  # no client certificate: the handshake fails
    finally:
        d.stop()
