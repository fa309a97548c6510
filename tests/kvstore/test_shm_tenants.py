"""No tenant reads another's blocks through shared memory (kvstore/server/read_access.py).

The daemon here runs with a ReadAccess of several credentials (what per-tenant tokens plug in):
a tenant is never handed the cpu arena (every one of its Gets is copied into its own segment),
a block it may not read is a miss on the shared-memory path, a lookup tells it no arena offsets,
and a session serves only the caller that attached it. The admin, who may read everything, keeps
the zero-copy path, as does a daemon with one credential (test_shm_arena.py).
"""

from __future__ import annotations

from collections.abc import Hashable

import grpc
import pytest

from kvstore.client.shm import HEADER_BYTES
from kvstore.errors import KVStoreError
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.auth import ClientAuth
from tests.fixtures_kvstore import WAIT_S, block, connect, fetch, inprocess_daemon

TOKENS = {"admin-token-000000000": "admin", "alpha-token-000000000": "alpha", "beta-token-0000000000": "beta"}


class TokenTenants:
    """The caller is the tenant its bearer token names; a tenant reads the keys that start with
    its name, the admin every key."""

    def caller(self, context: grpc.ServicerContext) -> Hashable:
        md = dict(context.invocation_metadata())
        return TOKENS.get(str(md.get("authorization", "")).removeprefix("Bearer "))

    def sees_all(self, caller: Hashable) -> bool:
        return caller == "admin"

    def may_read(self, caller: Hashable, key: bytes) -> bool:
        return caller == "admin" or (isinstance(caller, str) and key.startswith(caller.encode()))


def _as(name: str) -> ClientAuth:
    return ClientAuth(next(t for t, n in TOKENS.items() if n == name))


def test_a_tenant_gets_no_arena_and_only_its_own_blocks() -> None:
    with inprocess_daemon(access=TokenTenants()) as d, \
            connect(d, auth=_as("admin"), use_shm=True) as admin, \
            connect(d, auth=_as("alpha"), use_shm=True) as alpha:  # fmt: skip
        (ka, va), (kb, vb) = block("alpha-1", 1.0), block("beta-1", 2.0)
        admin.put_many([(ka, va), (kb, vb)])
        assert fetch(alpha, [ka, kb]) == [va, None], "a tenant read another tenant's block"
        assert not alpha.arena_active, "a tenant was handed the arena, which holds every tenant's blocks"
        assert fetch(admin, [ka, kb]) == [va, vb] and admin.arena_active  # zero-copy for who sees all
        assert alpha.lookup([ka], in_place=True).in_place is None
        ((seg, sid),) = alpha._shm._free
        resp = alpha._stub.GetShm(pb.GetRequest(keys=[ka], shm_session=sid, shm_offset=HEADER_BYTES,
                                                shm_length=seg.size - HEADER_BYTES, arena=True), timeout=WAIT_S)
        assert [(b.found, b.arena) for b in resp.shm] == [(True, False)], "a tenant was answered in the arena"
        assert admin.lookup([ka], in_place=True).in_place is not None
        with pytest.raises(KVStoreError, match="no arena"):
            with connect(d, auth=_as("alpha"), use_shm=True, use_arena=True) as insists:
                fetch(insists, [ka])


def test_a_session_serves_only_the_caller_that_attached_it() -> None:
    with inprocess_daemon(access=TokenTenants()) as d, \
            connect(d, auth=_as("alpha"), use_shm=True) as alpha, \
            connect(d, auth=_as("beta"), use_shm=True) as beta:  # fmt: skip
        key, value = block("beta-steal", 3.0)
        alpha.put(*block("alpha-warm", 0.0))
        ((seg, sid),) = alpha._shm._free
        seg.buf[HEADER_BYTES : HEADER_BYTES + len(value)] = value  # what alpha is about to put
        msgs = [pb.PutRequest(begin=pb.PutBegin(blocks=[pb.BlockSpec(key=key, size=len(value))], shm_session=sid)),
                pb.PutRequest(commit=pb.PutCommit(shm=[pb.ShmRef(index=0, offset=HEADER_BYTES,
                                                                 length=len(value))]))]  # fmt: skip
        with pytest.raises(grpc.RpcError) as ei:
            beta._stub.Put(iter(msgs), timeout=WAIT_S)  # beta storing what lies in alpha's segment
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert alpha._stub.Put(iter(msgs), timeout=WAIT_S).status == [pb.STORED]  # alpha itself may
        beta._stub.DetachShm(pb.DetachShmRequest(session=sid), timeout=WAIT_S)
        with d.sessions.use(sid, "alpha"):
            pass  # still alpha's
