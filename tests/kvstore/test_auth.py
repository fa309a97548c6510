"""The daemon serves only callers with its bearer token; health stays open; the token is never shown.

Real daemons on loopback (in-process ``Daemon`` and ``kvstore serve`` subprocesses), real clients.
"""

from __future__ import annotations

import os
import socket
import stat
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.servers import running_daemon
from kvstore.cli import main as cli_main
from kvstore.client.client import KVStoreClient
from kvstore.client.retry import Retry
from kvstore.config.store_config import StoreConfig, TierConfig, load_config
from kvstore.proto import kvstore_pb2
from kvstore.server import stream_wire as w
from kvstore.server.auth import AuthError, ClientAuth, default_token_file
from kvstore.server.daemon import Daemon
from tests.fixtures_kvstore import connect, fetch_one
from tests.kvstore.support import KEY, TOKEN, WRONG, auth_block
from tiers.errors import ConfigError

SERVICE = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"]


def _refused(d: Daemon, reason: str) -> float:
    return d.metrics.registry.get_sample_value("tierkv_auth_refused_total", {"reason": reason}) or 0.0


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    d = Daemon(StoreConfig(tiers=(TierConfig("cpu", 64 << 20),), listen="127.0.0.1:0", token=TOKEN))
    d.start()
    yield d
    d.stop()


def _client(d: Daemon, token: str, **kw: object) -> KVStoreClient:
    return connect(d, deadline_s=10.0, retry=Retry(attempts=1), auth=ClientAuth(token), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("token,reason", [("", "missing"), (WRONG, "wrong")])
def test_every_call_refused_without_the_token(daemon: Daemon, token: str, reason: str) -> None:
    """Each KVStore method, called with an empty request on a raw channel: UNAUTHENTICATED, counted."""
    auth = ClientAuth(token)
    with auth.channel(daemon.address, []) as ch:
        for m in SERVICE.methods:
            path = f"/{SERVICE.full_name}/{m.name}"
            ident = (lambda b: b, lambda b: b)
            if m.client_streaming:
                call = ch.stream_stream(path, *ident) if m.server_streaming else ch.stream_unary(path, *ident)
                args = iter([b""])
            else:
                call = ch.unary_stream(path, *ident) if m.server_streaming else ch.unary_unary(path, *ident)
                args = b""
            with pytest.raises(grpc.RpcError) as e:
                out = call(args, timeout=10)
                list(out) if m.server_streaming else out
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, m.name
            assert TOKEN not in (e.value.details() or "") and WRONG not in (e.value.details() or "")
    assert _refused(daemon, reason) == len(SERVICE.methods)


@pytest.mark.parametrize("use_shm", [True, False], ids=["shm", "stream"])
def test_wrong_token_never_served(daemon: Daemon, use_shm: bool) -> None:
    """Nothing written, nothing read, typed error naming no secret; the right token works."""
    with _client(daemon, WRONG, use_shm=use_shm) as bad:
        with pytest.raises(AuthError, match="wrong bearer token") as e:
            bad.put(KEY, auth_block())
        assert WRONG not in str(e.value)
        assert daemon.store.lookup([KEY]).prefix_len == 0
    with _client(daemon, TOKEN, use_shm=use_shm) as good:
        assert good.put(KEY, auth_block())
        assert fetch_one(good, KEY) == auth_block()
    with _client(daemon, "", use_shm=use_shm) as anon:
        with pytest.raises(AuthError, match="missing bearer token"):
            fetch_one(anon, KEY)
        with pytest.raises(AuthError):
            anon.stats()
    assert _refused(daemon, "wrong") >= 1 and _refused(daemon, "missing") >= 2


def test_health_open_without_token(daemon: Daemon) -> None:
    """k8s gRPC probes and `kvstore health` send no metadata: health answers SERVING, counts nothing."""
    with grpc.insecure_channel(daemon.address) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert r.status == health_pb2.HealthCheckResponse.SERVING
    with _client(daemon, "") as anon:
        assert anon.health()
    os.environ["TIERKV_TOKEN_FILE"] = "/nonexistent/token"  # e.g. compose: checked before the file exists
    try:
        assert cli_main(["health", "--address", daemon.address, "--deadline", "10"]) == 0
    finally:
        del os.environ["TIERKV_TOKEN_FILE"]
    assert _refused(daemon, "missing") == 0


def test_stream_channel_inherits_auth(daemon: Daemon) -> None:
    """No token -> no OpenStream -> no channel token; a guessed token gets no bytes of a block."""
    assert daemon.streams is not None
    with _client(daemon, TOKEN, use_shm=False) as good:
        good.put(KEY, auth_block())
    with _client(daemon, "", use_shm=False, use_stream=True) as anon:
        with pytest.raises(AuthError):
            fetch_one(anon, KEY)
    assert not daemon.streams._tokens  # OpenStream never ran: nothing was issued
    with socket.create_connection(("127.0.0.1", daemon.streams.port), timeout=10) as s:
        s.sendall(os.urandom(w.TOKEN_BYTES) + w.encode_request([KEY]))
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
    assert got == b""
    with _client(daemon, TOKEN, use_shm=False, use_stream=True) as good:  # the channel itself works
        assert fetch_one(good, KEY) == auth_block()


def test_metrics_http_is_read_only() -> None:
    d = Daemon(StoreConfig(tiers=(TierConfig("cpu", 1 << 20),), listen="127.0.0.1:0", token=TOKEN,
                           metrics_listen="127.0.0.1:0"))  # fmt: skip
    d.start()
    try:
        url = f"http://127.0.0.1:{d.metrics_port}/metrics"
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        assert "tierkv_auth_refused_total" in body and TOKEN not in body
        for method in ("POST", "PUT", "DELETE"):
            with pytest.raises(urllib.error.HTTPError):
                urllib.request.urlopen(urllib.request.Request(url, data=b"x", method=method), timeout=10)
    finally:
        d.stop()


def test_default_token_file_shared_by_daemon_and_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No token anywhere: the daemon creates <runtime dir>/token 0600; a client finds it; a second
    daemon reuses it."""
    for var in ("TIERKV_TOKEN", "TIERKV_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TIERKV_CACHE_DIR", str(tmp_path / "rt"))
    path = default_token_file()
    assert path == tmp_path / "rt" / "token" and not path.exists()
    cfg = StoreConfig(tiers=(TierConfig("cpu", 1 << 20),), listen="127.0.0.1:0")
    d1, d2 = Daemon(cfg), Daemon(cfg)
    for d in (d1, d2):
        d.start()
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        for d in (d1, d2):
            with connect(d, deadline_s=10.0) as c:
                assert c.put(KEY, auth_block())
        with _client(d1, "") as anon, pytest.raises(AuthError):
            anon.lookup([KEY])
    finally:
        d1.stop()
        d2.stop()
    monkeypatch.delenv("TIERKV_CACHE_DIR")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    assert default_token_file() == tmp_path / "xdg" / "tierkv" / "token"


def test_launched_daemon_needs_no_flag(tmp_path: Path) -> None:
    """`kvstore serve` via bench/servers.py (demo, benches, tests): the default client finds the token."""
    with running_daemon(tmp_path / "a", "--cpu", "8MiB") as address:
        with connect(address, deadline_s=10.0) as c:
            assert c.put(KEY, auth_block())
        with connect(address, deadline_s=10.0, retry=Retry(attempts=1), auth=ClientAuth("")) as anon:
            with pytest.raises(AuthError):
                anon.lookup([KEY])
    token_file = tmp_path / "remote-token"
    token_file.write_text(TOKEN + "\n")
    with running_daemon(tmp_path / "b", "--cpu", "8MiB", "--token-file", str(token_file)) as address:
        auth = ClientAuth.from_env({"TIERKV_TOKEN": TOKEN})  # a remote engine's env
        with connect(address, deadline_s=10.0, auth=auth) as c:
            assert c.put(KEY, auth_block())
        assert cli_main(["stats", "--address", address, "--token-file", str(token_file)]) == 0
        assert cli_main(["stats", "--address", address, "--token-file", str(tmp_path / "missing")]) == 2
    with running_daemon(tmp_path / "c", "--cpu", "8MiB", "--no-auth") as address:
        with connect(address, deadline_s=10.0, auth=ClientAuth("")) as c:
            assert c.put(KEY, auth_block())


def test_secrets_never_shown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config(["--cpu", "8MiB"], env={"TIERKV_TOKEN": TOKEN})
    assert cfg.token == TOKEN and TOKEN not in repr(cfg)
    assert TOKEN not in repr(ClientAuth(TOKEN)) and "<set>" in repr(ClientAuth(TOKEN))
    os.environ["TIERKV_TOKEN"] = TOKEN
    try:
        assert cli_main(["serve", "--cpu", "8MiB", "--check-config"]) == 0
    finally:
        del os.environ["TIERKV_TOKEN"]
    out = capsys.readouterr().out
    assert "auth: bearer token from TIERKV_TOKEN" in out and TOKEN not in out
    assert cli_main(["serve", "--cpu", "8MiB", "--no-auth", "--check-config"]) == 0
    assert "auth: OFF" in capsys.readouterr().out
    with pytest.raises(ConfigError) as e:
        load_config(["--cpu", "8MiB"], env={"TIERKV_TOKEN": "short-secret"})
    assert "too short" in str(e.value) and "short-secret" not in str(e.value)


def test_bad_auth_config_one_line(tmp_path: Path) -> None:
    pem = tmp_path / "x.pem"
    pem.write_text("x")
    for argv, msg in [
        (["--tls-cert", str(pem)], "go together"),
        (["--tls-client-ca", str(pem)], "needs tls_cert"),
        (["--tls-cert", str(tmp_path / "none.pem"), "--tls-key", str(pem)], "cannot read"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            load_config(["--cpu", "8MiB", *argv], env={})
    bad = tmp_path / "bad-token"
    bad.write_text("has spaces in the token value\n")
    with pytest.raises(ConfigError, match="printable ASCII"):
        ClientAuth.from_env({"TIERKV_TOKEN_FILE": str(bad)})
