"""No tenant reads another's blocks through shared memory: the credentials file decides
(kvstore/server/credentials.py, the same ``Caller`` every gRPC and raw-channel call is checked
against).

The daemon here is the real one (``Daemon``, in this process so a test can reach its sessions),
with a credentials file of two tenants, a second credential of the first tenant, and an admin.
A tenant is never handed the cpu arena (not on the socket, not by a lookup, not in a Get), a key
of another tenant over shared memory is PERMISSION_DENIED as over gRPC, and a session serves only
the credential that attached it, even another credential of the same tenant. The admin, and the
one credential of a daemon without a credentials file, keep the zero-copy arena.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvstore.block import encode_block
from kvstore.client.client import KVStoreClient
from kvstore.client.retry import Retry
from kvstore.client.shm import HEADER_BYTES, ShmSegment
from kvstore.client.shm_link import join
from kvstore.errors import KVStoreError, PermissionDenied
from kvstore.keys import Namespace, chain_keys
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.auth import ClientAuth
from kvstore.server.daemon import Daemon
from tests.fixtures_kvstore import WAIT_S, connect, fetch, served

pytestmark = pytest.mark.timeout(120)
NS = Namespace.from_model({"n_layer": 2}, "sha256:shm-tenants", "float32", page_size=4)
ALPHA = "alpha-token-0123456789abcdef"
ALPHA2 = "alpha2-token-0123456789abcdef"  # another credential of tenant alpha
BETA = "beta-token-0123456789abcdef00"
OPS = "ops-token-0123456789abcdef0000"
SIZE = 4 * 1024 * 1024


def write_credentials(path: Path, ops_admin: bool = True) -> Path:
    ops = "admin: true" if ops_admin else "tenants: [beta]"
    path.write_text("credentials:\n"
                    f'  - token: "{ALPHA}"\n    tenants: [alpha]\n'
                    f'  - token: "{ALPHA2}"\n    tenants: [alpha]\n'
                    f'  - token: "{BETA}"\n    tenants: [beta]\n'
                    f'  - token: "{OPS}"\n    {ops}\n')  # fmt: skip
    return path


def kv(tenant: str, seed: int) -> tuple[bytes, bytes]:
    (key,) = chain_keys(NS.in_tenant(tenant), [seed] * 4)
    return key, encode_block(key, np.full(4096, seed, np.float32))


def client(d: Daemon, token: str, **kw: object) -> KVStoreClient:
    return connect(d, deadline_s=10.0, retry=Retry(attempts=1), auth=ClientAuth(token), **kw)  # type: ignore[arg-type]


def md(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def session_of(c: KVStoreClient) -> tuple[ShmSegment, str]:
    """The client's one attached segment and its session id (it read over shared memory)."""
    ((seg, sid),) = c._shm._free
    return seg, sid


def get_shm(c: KVStoreClient, token: str, sid: str, keys: list[bytes], arena: bool = True) -> pb.GetResponse:
    return c._stub.GetShm(pb.GetRequest(keys=keys, shm_session=sid, shm_offset=HEADER_BYTES,
                                        shm_length=SIZE // 2, arena=arena),
                          metadata=md(token), timeout=WAIT_S)  # fmt: skip


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    creds = write_credentials(tmp_path / "credentials.yaml")
    with served(tmp_path, "--cpu", "64MiB", "--no-stream", "--credentials-file", str(creds)) as d:
        yield d


def test_a_tenant_is_never_handed_the_arena_nor_another_tenants_block(daemon: Daemon) -> None:
    (ka, va), (kb, vb) = kv("alpha", 1), kv("beta", 2)
    with client(daemon, OPS, use_shm=True) as ops, client(daemon, ALPHA, use_shm=True) as alpha:
        ops.put_many([(ka, va), (kb, vb)])  # both in the cpu tier, so in the arena
        assert fetch(alpha, [ka]) == [va]  # its own block, over shared memory ...
        _, sid = session_of(alpha)
        assert not alpha.arena_active, "a tenant was handed the arena, which holds every tenant's blocks"
        resp = get_shm(alpha, ALPHA, sid, [ka])  # asks for the arena: copied into its segment instead
        assert [(b.found, b.arena) for b in resp.shm] == [(True, False)], "a tenant was answered in the arena"
        for keys in ([kb], [ka, kb]):  # ... never another tenant's: refused as the gRPC path refuses it
            with pytest.raises(grpc.RpcError) as ei:
                get_shm(alpha, ALPHA, sid, keys)
            assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(PermissionDenied):
                fetch(alpha, keys)
            assert session_of(alpha)[1] == sid  # a refusal costs the client no new segment
        assert alpha.lookup([ka], in_place=True).in_place is None  # no arena offsets either

        seg = ShmSegment.create(SIZE)  # on the socket itself: no arena fd, however it asks
        try:
            att = alpha._stub.AttachShm(pb.AttachShmRequest(size=seg.size, arena=True, by_fd=True),
                                        metadata=md(ALPHA), timeout=WAIT_S)  # fmt: skip
            conn, welcome, arena_fd = join(att.socket, att.ticket, seg.fd, seg.size, WAIT_S)
            conn.close()
            assert welcome.ok and welcome.arena_size == 0 and arena_fd is None
        finally:
            seg.close()
        with pytest.raises(KVStoreError, match="no arena"):
            with client(daemon, ALPHA, use_shm=True, use_arena=True) as insists:
                fetch(insists, [ka])

        assert fetch(ops, [ka, kb]) == [va, vb] and ops.arena_active  # the admin: zero-copy, every tenant
        assert ops.lookup([ka, kb], in_place=True).in_place is not None
        _, ops_sid = session_of(ops)
        assert [b.arena for b in get_shm(ops, OPS, ops_sid, [ka, kb]).shm] == [True, True]


def test_a_session_serves_only_the_credential_that_attached_it(daemon: Daemon) -> None:
    (kb, vb), (ka, va) = kv("beta", 3), kv("alpha", 4)
    with client(daemon, BETA, use_shm=True) as beta, client(daemon, ALPHA, use_shm=True) as alpha, \
            client(daemon, ALPHA2, use_shm=True) as alpha2:  # fmt: skip
        beta.put(kb, vb)
        alpha.put(ka, va)
        _, beta_sid = session_of(beta)
        alpha_seg, alpha_sid = session_of(alpha)
        alpha_seg.buf[HEADER_BYTES : HEADER_BYTES + len(va)] = va  # what alpha is about to put
        put = [pb.PutRequest(begin=pb.PutBegin(blocks=[pb.BlockSpec(key=ka, size=len(va))], shm_session=alpha_sid)),
               pb.PutRequest(commit=pb.PutCommit(shm=[pb.ShmRef(index=0, offset=HEADER_BYTES, length=len(va))]))]
        for token, sid, keys in ((ALPHA, beta_sid, [ka]), (BETA, alpha_sid, [kb]), (ALPHA2, alpha_sid, [ka])):
            with pytest.raises(grpc.RpcError) as ei:  # another credential's session, with keys it may read
                get_shm(beta, token, sid, keys)
            assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        # nor may it store from another credential's segment: beta may not write alpha's key at all,
        # alpha2 may, but not out of alpha's session
        for token, code in ((BETA, grpc.StatusCode.PERMISSION_DENIED), (ALPHA2, grpc.StatusCode.FAILED_PRECONDITION)):
            with pytest.raises(grpc.RpcError) as ei:
                alpha._stub.Put(iter(put), metadata=md(token), timeout=WAIT_S)
            assert ei.value.code() == code
            alpha._stub.ReleaseLease(pb.ReleaseLeaseRequest(session=alpha_sid, leases=[1, 2]), metadata=md(token))
            alpha._stub.DetachShm(pb.DetachShmRequest(session=alpha_sid), metadata=md(token), timeout=WAIT_S)
        assert alpha._stub.Put(iter(put), metadata=md(ALPHA), timeout=WAIT_S).status == [pb.ALREADY_PRESENT]
        assert [b.found for b in get_shm(alpha, ALPHA, alpha_sid, [ka]).shm] == [True]  # still alpha's, attached
        assert fetch(beta, [kb]) == [vb] and fetch(alpha2, [ka]) == [va]  # each through its own session


def test_a_credential_narrowed_by_a_reload_is_no_longer_answered_in_place(tmp_path: Path) -> None:
    creds = write_credentials(tmp_path / "credentials.yaml")
    (kb, vb) = kv("beta", 5)
    with served(tmp_path, "--cpu", "64MiB", "--no-stream", "--credentials-file", str(creds)) as d, \
            client(d, OPS, use_shm=True) as ops:  # fmt: skip
        ops.put(kb, vb)
        assert fetch(ops, [kb]) == [vb] and ops.arena_active
        _, sid = session_of(ops)
        write_credentials(creds, ops_admin=False)  # ops now a credential of tenant beta only
        assert d.reload_credentials()
        assert [b.arena for b in get_shm(ops, OPS, sid, [kb]).shm] == [False]  # copied, as for any tenant
        assert ops.lookup([kb], in_place=True).in_place is None


def test_the_one_credential_of_a_daemon_without_a_credentials_file_keeps_the_arena(tmp_path: Path) -> None:
    key, value = kv("alpha", 6)
    token = "one-token-0123456789abcdef00"
    (tmp_path / "token").write_text(token + "\n")
    with served(tmp_path, "--cpu", "64MiB", "--no-stream", "--token-file", str(tmp_path / "token")) as d:
        assert os.path.exists(d.sessions.socket_path)
        with client(d, token, use_shm=True) as c:
            c.put(key, value)
            assert fetch(c, [key]) == [value] and c.arena_active
            _, sid = session_of(c)
            assert [b.arena for b in get_shm(c, token, sid, [key]).shm] == [True]
