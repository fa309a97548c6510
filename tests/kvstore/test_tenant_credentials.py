"""A daemon with a credentials file (``kvstore serve --credentials-file``, a real process): a tenant's
token reaches only its own tenant's keys, by every path that names keys (Lookup, Get over shared
memory, the raw TCP channel and gRPC streaming, Put, Delete, Stats), and is refused with
PERMISSION_DENIED and no partial effect; the other tenant's blocks stay intact. The shared namespace
is read-only to tenants; untagged keys need tenant ``default``; traces need admin. The quota holds per
tenant whatever salts its keys use. SIGHUP reloads the file, and a revoked token loses even the raw
connection it opened before."""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvstore.block import encode_block
from kvstore.client.client import KVStoreClient
from kvstore.client.retry import Retry
from kvstore.config.store_config import StoreConfig, TierConfig
from kvstore.errors import PermissionDenied
from kvstore.keys import Namespace, chain_keys
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.server import stream_wire as w
from kvstore.server.auth import AuthError, ClientAuth
from kvstore.server.daemon import Daemon as ServedDaemon
from kvstore.store.tenants import name_of_salt, name_of_tenant
from tests.fixtures_kvstore import WAIT_S, Daemon, connect, daemon, fetch

pytestmark = pytest.mark.timeout(300)
NS = Namespace.from_model({"n_layer": 2}, "sha256:tc", "float32", page_size=4)
ACME = "acme-token-0123456789abcdef"
GLOBEX = "globex-token-0123456789abcdef"
PLAIN = "plain-token-0123456789abcdef00"  # tenant "default": untagged keys
OPS = "ops-token-0123456789abcdef0000"
BLOCK = 64 * 1024
TRANSPORTS = {"shm": {"use_shm": True}, "stream": {"use_shm": False, "use_stream": True},
              "grpc": {"use_shm": False, "use_stream": False}}


def credentials_file(tmp: Path, acme: bool = True) -> Path:
    (tmp / "acme.token").write_text(ACME + "\n")
    entries = ["  - token_file: acme.token\n    tenants: [acme]\n"] if acme else []
    entries += [f'  - token: "{GLOBEX}"\n    tenants: [globex]\n', f'  - token: "{PLAIN}"\n    tenants: [default]\n',
                f'  - token: "{OPS}"\n    admin: true\n']
    path = tmp / "credentials.yaml"
    path.write_text("credentials:\n" + "".join(entries))
    return path


def keys(ns: Namespace, n: int, seed: int) -> list[bytes]:
    return chain_keys(ns, [seed * 1000 + i for i in range(4 * n)])


def value(key: bytes, fill: int) -> bytes:
    head = len(encode_block(key, np.zeros(0, np.uint8)))
    return encode_block(key, np.full(BLOCK - head, fill, np.uint8))


def client(d: Daemon | ServedDaemon | str, token: str, **kw: object) -> KVStoreClient:
    return connect(d, deadline_s=10.0, retry=Retry(attempts=1), auth=ClientAuth(token), **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("credentials")
    with daemon(tmp, "--cpu", "64MiB", "--credentials-file", str(credentials_file(tmp))) as d:
        yield d


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_tenant_reaches_none_of_another_tenants_keys(served: Daemon, transport: str) -> None:
    seed = list(TRANSPORTS).index(transport)
    a, b = keys(NS.in_tenant("acme", "s1"), 3, seed=seed), keys(NS.in_tenant("globex"), 3, seed=7 + seed)
    with client(served, OPS) as ops, client(served, ACME, **TRANSPORTS[transport]) as acme:
        ops.put_many([(k, value(k, 0xB)) for k in b])
        assert acme.put_many([(k, value(k, 0xA)) for k in a]) == [True] * 3  # its own: fine
        assert acme.lookup(a).prefix_len == 3 and fetch(acme, a) == [value(k, 0xA) for k in a]
        for keys_ in ([b[0]], [a[0], b[1]]):  # another's key alone, or among its own: the whole call refused
            with pytest.raises(PermissionDenied, match="outside the tenants of credentials"):
                acme.lookup(keys_)
            with pytest.raises(PermissionDenied):
                acme.lookup(keys_, read=False)
            with pytest.raises(PermissionDenied):
                fetch(acme, keys_)
            with pytest.raises(PermissionDenied):
                acme.delete(keys_)
        new_a = keys(NS.in_tenant("acme", "s2"), 1, seed=99)[0]
        with pytest.raises(PermissionDenied):
            acme.put(b[0], value(b[0], 0xEE))  # overwrite attempt (same key, other bytes)
        with pytest.raises(PermissionDenied):
            acme.put_many([(new_a, value(new_a, 0xA)), (b[2], value(b[2], 0xEE))])
        assert ops.lookup([new_a]).tiers == [None]  # no partial effect: its own block was not stored either
        assert acme.lookup(a).prefix_len == 3  # ... nor were its own deleted by the refused Delete
        assert fetch(ops, b) == [value(k, 0xB) for k in b]  # globex's blocks, intact


def test_stats_show_a_tenant_its_own_rows_only(served: Daemon) -> None:
    a, b = keys(NS.in_tenant("acme"), 2, seed=11), keys(NS.in_tenant("globex"), 3, seed=12)
    with client(served, OPS) as ops, client(served, ACME, use_shm=False) as acme:
        ops.put_many([(k, value(k, 1)) for k in a + b])
        mine = acme.stats()
        assert {t.tenant for t in mine.tenants} == {"acme"}  # never globex's name, bytes or counts
        assert all(t.used_bytes == 0 and t.blocks == 0 and t.hits == 0 for t in mine.tiers)  # totals count others
        assert [t.name for t in mine.tiers] == ["cpu"] and mine.tiers[0].capacity_bytes == 64 * 2**20
        everything = {t.tenant: t.blocks for t in ops.stats().tenants}
        assert everything["globex"] >= 3 and everything["acme"] >= 2  # admin: every row, by configured name
        assert name_of_tenant("globex") not in everything


def test_the_shared_namespace_is_read_only_to_tenants(served: Daemon) -> None:
    shared = chain_keys(NS.in_tenant("acme"), list(range(8)), shared_pages=2)[:2]
    with client(served, OPS) as ops, client(served, ACME, use_shm=False) as acme:
        ops.put_many([(k, value(k, 5)) for k in shared])
        assert acme.lookup(shared).prefix_len == 2 and fetch(acme, shared) == [value(k, 5) for k in shared]
        other = chain_keys(NS.in_tenant("acme"), list(range(100, 104)), shared_pages=1)[0]
        with pytest.raises(PermissionDenied, match="only an admin credential writes"):
            acme.put(other, value(other, 6))
        with pytest.raises(PermissionDenied, match="only an admin credential writes"):
            acme.delete(shared)
        assert ops.lookup([other]).tiers == [None] and ops.lookup(shared).prefix_len == 2
        assert ops.delete(shared) == 2  # admin writes it


def test_untagged_keys_need_tenant_default(served: Daemon) -> None:
    plain_keys, legacy = keys(NS, 1, seed=21), keys(NS.with_tenant("old-salt"), 1, seed=22)
    with client(served, PLAIN, use_shm=False) as plain, client(served, ACME, use_shm=False) as acme:
        assert plain.put(plain_keys[0], value(plain_keys[0], 3))
        assert fetch(plain, plain_keys) == [value(plain_keys[0], 3)]
        with pytest.raises(PermissionDenied, match="untagged"):
            fetch(acme, plain_keys)
        for c in (plain, acme):  # a salt-tagged (legacy) key is nobody's tenant but an admin's
            with pytest.raises(PermissionDenied):
                c.put(legacy[0], value(legacy[0], 4))
        with pytest.raises(PermissionDenied):
            plain.lookup(keys(NS.in_tenant("acme"), 1, seed=23))


def test_traces_are_an_admins(served: Daemon) -> None:
    with client(served, ACME, use_shm=False) as acme:
        with pytest.raises(PermissionDenied, match="TraceStart needs an admin credential"):
            acme.trace_start()
        with pytest.raises(PermissionDenied, match="TraceStop needs an admin credential"):
            acme.trace_stop()
    with client(served, OPS, use_shm=False) as ops:
        ops.trace_start(max_records=16)
        assert ops.trace_stop()[1] >= 0


def _grant(address: str, token: str) -> tuple[int, bytes]:
    with ClientAuth(token).channel(address, []) as ch:
        r = pb_grpc.KVStoreStub(ch).OpenStream(pb.OpenStreamRequest(), timeout=10)
    assert r.ok
    return r.port, r.token


def _ask(conn: socket.socket, wanted: list[bytes]) -> list[tuple[int, bytes]]:
    """One raw-channel request: the frames answered (kind, payload), up to DONE or an error."""
    conn.sendall(w.encode_request(wanted))
    frames = []
    while True:
        kind, n = w.FRAME.unpack(w.recv_exact(conn, w.FRAME.size))
        frames.append((kind, w.recv_exact(conn, n) if n else b""))
        if kind not in (w.FOUND, w.MISS):
            return frames


def test_the_raw_channel_checks_every_key_against_the_token_that_opened_it(served: Daemon) -> None:
    """A raw socket, as an attacker holding acme's token would use it: the grant carries acme's
    credential, so globex's key gets ERR_DENIED and not a byte of its block."""
    a, b = keys(NS.in_tenant("acme"), 1, seed=31)[0], keys(NS.in_tenant("globex"), 1, seed=32)[0]
    with client(served, OPS, use_shm=False) as ops:
        ops.put_many([(a, value(a, 1)), (b, value(b, 2))])
    host = served.address.rpartition(":")[0]
    port, token = _grant(served.address, ACME)
    with socket.create_connection((host, port), timeout=10) as conn:
        conn.sendall(token)
        assert _ask(conn, [a]) == [(w.FOUND, value(a, 1)), (w.DONE, b"")]
        (kind, msg), = _ask(conn, [a, b])  # one refused key: nothing at all, not even a's block
        assert kind == w.ERR_DENIED and b"permission denied" in msg
    port, token = _grant(served.address, GLOBEX)
    with socket.create_connection((host, port), timeout=10) as conn:
        conn.sendall(token)
        assert _ask(conn, [b]) == [(w.FOUND, value(b, 2)), (w.DONE, b"")]


def test_the_quota_holds_per_tenant_across_rotating_salts(tmp_path: Path) -> None:
    """Each request salt is a sub-namespace of acme, charged to acme: 8 blocks under 8 salts keep
    acme at its 3-block quota and leave globex's blocks in the top tier. The old escape, keys
    tagged by a fresh salt (a new "tenant" each), is refused."""
    flags = ("--cpu", str(16 * BLOCK), "--disk", f"{tmp_path / 'disk'}:{64 * BLOCK}", "--tenant-quota",
             str(3 * BLOCK), "--credentials-file", str(credentials_file(tmp_path)))
    with daemon(tmp_path, *flags) as d:
        with client(d, ACME, use_shm=False) as acme, client(d, GLOBEX, use_shm=False) as globex:
            g = keys(NS.in_tenant("globex"), 2, seed=41)
            globex.put_many([(k, value(k, 1)) for k in g])
            for i in range(8):
                (k,) = keys(NS.in_tenant("acme", f"salt-{i}"), 1, seed=50 + i)
                acme.put(k, value(k, 2))
            for i in range(3):
                (k,) = keys(NS.with_tenant(f"fresh-salt-{i}"), 1, seed=60 + i)
                with pytest.raises(PermissionDenied):
                    acme.put(k, value(k, 3))
            deadline = time.monotonic() + WAIT_S
            with client(d, OPS, use_shm=False) as ops:
                while ops.stats().pending_blocks and time.monotonic() < deadline:
                    time.sleep(0.05)
                rows = {(t.tier, t.tenant): t for t in ops.stats().tenants}
                assert rows[("cpu", "acme")].used_bytes <= 3 * BLOCK
                assert rows[("cpu", "acme")].quota_spills >= 5 and rows[("disk", "acme")].blocks >= 5
                assert ops.lookup(g).tiers == ["cpu", "cpu"]  # globex kept its place
                assert not any(t.startswith(name_of_salt("fresh-salt-0")) for _, t in rows)


def test_sighup_reloads_the_file_and_revokes_open_connections(tmp_path: Path) -> None:
    path = credentials_file(tmp_path)
    (a,) = keys(NS.in_tenant("acme"), 1, seed=71)
    with daemon(tmp_path, "--cpu", "64MiB", "--credentials-file", str(path)) as d:
        assert d.proc is not None
        with client(d, ACME, use_shm=False) as acme:
            acme.put(a, value(a, 1))
        host = d.address.rpartition(":")[0]
        port, token = _grant(d.address, ACME)
        conn = socket.create_connection((host, port), timeout=10)
        conn.sendall(token)
        assert _ask(conn, [a])[0][0] == w.FOUND
        path.write_text("credentials: [")  # a broken file: the daemon keeps the credentials it has
        d.proc.send_signal(signal.SIGHUP)
        _wait_for_log(d, "credentials not reloaded")
        assert _ask(conn, [a])[0][0] == w.FOUND
        credentials_file(tmp_path, acme=False)  # acme's credential revoked
        d.proc.send_signal(signal.SIGHUP)
        _wait_for_log(d, "credentials reloaded")
        assert _ask(conn, [a])[0][0] == w.ERR_DENIED  # the connection opened before: refused now
        conn.close()
        with client(d, ACME, use_shm=False) as acme, pytest.raises(AuthError):
            acme.lookup([a])
        with client(d, OPS, use_shm=False) as ops:
            assert ops.lookup([a]).prefix_len == 1


def _wait_for_log(d: Daemon, needle: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while needle not in d.log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert needle in d.log.read_text()


def test_single_token_mode_is_unchanged() -> None:
    """No credentials file: the one token is admin, as before: every tag, untagged keys, the shared
    namespace, Stats rows by tag, traces."""
    token = "single-token-0123456789abcdef"
    d = ServedDaemon(StoreConfig(tiers=(TierConfig("cpu", 64 << 20),), listen="127.0.0.1:0", token=token))
    d.start()
    try:
        every = [*keys(NS.with_tenant("salt-x"), 1, 81), *keys(NS, 1, 82), *keys(NS.in_tenant("acme"), 1, 83),
                 chain_keys(NS, list(range(4)), shared_pages=1)[0]]
        with client(d, token, use_shm=False) as c:
            assert c.put_many([(k, value(k, 1)) for k in every]) == [True] * 4
            assert fetch(c, every) == [value(k, 1) for k in every]
            assert {t.tenant for t in c.stats().tenants} == {name_of_salt("salt-x"), "default",
                                                             name_of_tenant("acme"), "shared"}
            c.trace_start(max_records=4)
            c.trace_stop()
            assert c.delete(every) == 4
        with client(d, "not-the-token-0123456789", use_shm=False) as bad, pytest.raises(AuthError):
            bad.lookup(every)
    finally:
        d.stop()


def test_every_call_that_names_keys_answers_permission_denied(served: Daemon) -> None:
    """The status itself, on a raw stub: PERMISSION_DENIED (the client's PermissionDenied, never
    retried), not UNAUTHENTICATED (the token is valid) nor a miss."""
    b = keys(NS.in_tenant("globex"), 1, seed=91)
    put = [pb.PutRequest(begin=pb.PutBegin(blocks=[pb.BlockSpec(key=b[0], size=BLOCK)]))]
    with ClientAuth(ACME).channel(served.address, []) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        calls = {"Lookup": lambda: stub.Lookup(pb.LookupRequest(keys=b), timeout=10),
                 "Delete": lambda: stub.Delete(pb.DeleteRequest(keys=b), timeout=10),
                 "Get": lambda: list(stub.Get(pb.GetRequest(keys=b), timeout=10)),
                 "GetShm": lambda: stub.GetShm(pb.GetRequest(keys=b, shm_session="x"), timeout=10),
                 "Put": lambda: stub.Put(iter(put), timeout=10)}
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
            assert ACME not in (e.value.details() or "")
