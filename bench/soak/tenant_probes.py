"""Cross-tenant reads attempted through every path, judged by what came back, never by what a
server says of itself (bench/soak/security_figures.py classifies each attempt).

The keys probed are real: those of a private prompt the ``probe`` tenant sent, read out of Redis
(every block is written through to it) under that tenant's tag — no client of the load sends that
tenant, so every key under its tag is one of the probe's own. Then, with another tenant's
credential (tenant B's daemon token, B's API key):

- **gRPC** Lookup, Get and Delete of A's keys;
- **the raw TCP channel**: a grant from OpenStream, then a Get of A's keys on it;
- **shared memory**: attach a segment asking for the cpu arena (which holds every tenant's
  blocks: handing its fd to B is a read), then GetShm of A's keys into B's own session;
- **the engine**: B's API key asks for A's private prompt on a replica that holds it. Judged by
  the answer's page sources (``usage.prompt_tokens_details.tierkv``: no page from the radix tree
  or loaded from the daemon) and by the daemon: an access trace (admin) spans B's requests, and
  any read of A's keys that hit is a read, whoever's request it served.

Only PERMISSION_DENIED / UNAUTHENTICATED (on the raw channel its ERR_DENIED frame) is a refusal;
anything served is a read; anything else (a timeout, the daemon down) is unclear, reported apart.
A control asks the admin credential for the same keys: held keys make a refusal meaningful.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import redis

from bench.soak.cluster import Cluster
from bench.soak.load import Answer, Load, Prompt
from bench.soak.security_figures import MISSED, READ, REFUSED, UNCLEAR, Attempt, engine_attempt, grpc_outcome
from bench.soak.tenancy import PROBE
from kvstore.client.shm import ShmSegment
from kvstore.client.shm_link import join
from kvstore.keys import TENANT_MAGIC, tenant_tag
from kvstore.ops.trace import MISS, OP_NAMES, key_hash, read_trace
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.server import stream_wire as w

REDIS_PREFIX = b"tierkv:"
WAIT_S = 10.0
TRACE_RECORDS = 200_000  # 4.8 MB of ring: the seconds of B's requests, with the load around them


def tenant_keys(redis_url: str, tenant: str) -> set[bytes]:
    """Every key of ``tenant`` held in Redis now (its tag after the tier's prefix)."""
    prefix = REDIS_PREFIX + TENANT_MAGIC + tenant_tag(tenant)
    pattern = b"".join(b"\\" + bytes([c]) if c in b"*?[]\\" else bytes([c]) for c in prefix) + b"*"
    r = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=2)
    try:
        return {bytes(k)[len(REDIS_PREFIX) :] for k in r.scan_iter(match=pattern, count=1000)}
    finally:
        r.close()


def md(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def _attempt(path: str, call: Callable[[], Any]) -> Attempt:
    """A gRPC call that returned is a read; a refusal must be PERMISSION_DENIED/UNAUTHENTICATED."""
    try:
        call()
        return Attempt(path, READ, "served")
    except grpc.RpcError as e:
        return Attempt(path, grpc_outcome(e.code()), f"{e.code().name}: {(e.details() or '')[:120]}")


def grpc_attempts(address: str, token: str, keys: list[bytes]) -> list[Attempt]:
    """Lookup, Get and Delete of ``keys`` with ``token``."""
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        return [
            _attempt("grpc.Lookup", lambda: stub.Lookup(pb.LookupRequest(keys=keys, in_place=True), metadata=md(token),
                                                        timeout=WAIT_S)),
            _attempt("grpc.Get", lambda: list(stub.Get(pb.GetRequest(keys=keys), metadata=md(token), timeout=WAIT_S))),
            _attempt("grpc.Delete", lambda: stub.Delete(pb.DeleteRequest(keys=keys), metadata=md(token),
                                                        timeout=WAIT_S)),
        ]  # fmt: skip


def raw_attempt(address: str, token: str, keys: list[bytes]) -> Attempt:
    """A Get of ``keys`` on the raw channel, on a grant ``token`` obtained."""
    try:
        with grpc.insecure_channel(address) as ch:
            grant = pb_grpc.KVStoreStub(ch).OpenStream(pb.OpenStreamRequest(), metadata=md(token), timeout=WAIT_S)
    except grpc.RpcError as e:  # refused a grant: the channel itself refused B
        return Attempt("raw.Get", grpc_outcome(e.code()), f"OpenStream {e.code().name}")
    if not grant.ok:
        return Attempt("raw.Get", UNCLEAR, f"no grant: {grant.reason}")
    try:
        with socket.create_connection((address.rpartition(":")[0], grant.port), timeout=WAIT_S) as s:
            s.sendall(grant.token + w.encode_request(keys))
            kind, n = w.FRAME.unpack(w.recv_exact(s, w.FRAME.size))
            msg = w.recv_exact(s, min(n, 200)).decode(errors="replace") if kind >= w.ERR_INVALID else ""
    except (OSError, EOFError) as e:
        return Attempt("raw.Get", UNCLEAR, f"{type(e).__name__}: {e}")
    if kind in (w.FOUND, w.MISS, w.DONE):
        return Attempt("raw.Get", READ, f"frame {kind}")
    return Attempt("raw.Get", REFUSED if kind == w.ERR_DENIED else UNCLEAR, f"frame {kind}: {msg[:120]}")


def shm_attempts(address: str, token: str, keys: list[bytes], size: int = 4 << 20) -> list[Attempt]:
    """Attach asking for the arena, then GetShm of ``keys`` into this session."""
    seg = ShmSegment.create(size)
    out: list[Attempt] = []
    conn = None
    try:
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.KVStoreStub(ch)
            try:
                att = stub.AttachShm(pb.AttachShmRequest(size=seg.size, arena=True, by_fd=True), metadata=md(token),
                                     timeout=WAIT_S)  # fmt: skip
            except grpc.RpcError as e:
                return [Attempt("shm.attach", grpc_outcome(e.code()), e.code().name)]
            if not att.ok:
                return [Attempt("shm.attach", UNCLEAR, f"refused: {att.reason}")]
            assert seg.fd is not None
            conn, welcome, arena_fd = join(att.socket, att.ticket, seg.fd, seg.size, WAIT_S)
            if arena_fd is not None:
                os.close(arena_fd)
            handed = arena_fd is not None or welcome.arena_size > 0
            # the arena withheld while the session itself opens is this path's refusal
            out.append(Attempt("shm.arena", READ if handed else REFUSED if welcome.ok else UNCLEAR,
                               "arena fd handed to a tenant" if handed else "no arena"))  # fmt: skip
            if welcome.ok:
                out.append(_attempt("shm.GetShm", lambda: stub.GetShm(
                    pb.GetRequest(keys=keys, shm_session=welcome.session, shm_offset=4096, shm_length=size // 2,
                                  arena=True), metadata=md(token), timeout=WAIT_S)))  # fmt: skip
    except (OSError, ValueError) as e:
        out.append(Attempt("shm.attach", UNCLEAR, f"{type(e).__name__}: {e}"))
    finally:
        if conn is not None:
            conn.close()
        seg.close()
    return out


def held_by_admin(address: str, admin: str, keys: list[bytes]) -> int:
    """How many of ``keys`` the daemon holds (the control: a refusal of held keys means something)."""
    with grpc.insecure_channel(address) as ch:
        try:
            r = pb_grpc.KVStoreStub(ch).Lookup(pb.LookupRequest(keys=keys, write_check=True), metadata=md(admin),
                                               timeout=WAIT_S)  # fmt: skip
        except grpc.RpcError:
            return -1
    return sum(1 for t in r.tiers if t)


def daemon_reads(trace_path: str, keys: set[bytes]) -> int:
    """Reads (get or lookup) of ``keys`` that hit, in a trace file."""
    tr = read_trace(trace_path)
    rec = tr.records
    hashes = np.frombuffer(b"".join(key_hash(k) for k in keys), dtype="<u8") if keys else np.zeros(0, "<u8")
    reads = np.isin(rec["op"], [OP_NAMES.index("get"), OP_NAMES.index("lookup")]) & (rec["tier"] != MISS)
    return int(np.count_nonzero(reads & np.isin(rec["key"], hashes)))


class CrossTenant:
    """One round: the probe tenant's private prompt made hot everywhere, then every path tried by
    each other tenant. ``attempts`` accumulates over rounds."""

    def __init__(self, cluster: Cluster, load: Load) -> None:
        self.cluster, self.load = cluster, load
        self.attempts: list[Attempt] = []
        self.engine_answers: list[Answer] = []
        self.reference: dict[str, str] = {}
        self.rounds: list[dict[str, Any]] = []

    def round(self, prompt: Prompt, others: list[str]) -> None:
        c, reps = self.cluster, self.load.replicas
        info: dict[str, Any] = {"prompt": prompt.pid}
        try:
            before = tenant_keys(c.redis.url, PROBE)
        except redis.RedisError as e:
            before, info["redis_error"] = set(), str(e)[:120]
        first = self.load.ask(prompt, PROBE, reps[0], keep=False)
        if first.error is None and first.cached == 0:  # cold: a valid reference for this prompt
            self.reference[prompt.pid] = first.text
        self.load.ask(prompt, PROBE, reps[1 % len(reps)], keep=False)  # hot on both replicas and in the daemon
        try:
            keys = sorted(tenant_keys(c.redis.url, PROBE) - before)
        except redis.RedisError as e:
            keys, info["redis_error"] = [], str(e)[:120]
        info["keys"] = len(keys)
        with grpc.insecure_channel(c.daemon.address) as ch:  # the admin's trace spans B's requests
            admin = pb_grpc.KVStoreStub(ch)
            traced = False
            with contextlib.suppress(grpc.RpcError):  # a small ring: the default (24 MB) stays in the daemon's heap
                traced = bool(admin.TraceStart(pb.TraceStartRequest(max_records=TRACE_RECORDS), metadata=md(c.token),
                                               timeout=WAIT_S).path)  # fmt: skip
            answers = [self.load.ask(prompt, other, reps[i % len(reps)]) for i, other in enumerate(others)]
            witness: int | None = None
            if traced:
                with contextlib.suppress(grpc.RpcError, OSError, ValueError):
                    stopped = admin.TraceStop(pb.TraceStopRequest(), metadata=md(c.token), timeout=WAIT_S)
                    # a ring that overwrote records may have lost a read: no witness then
                    witness = daemon_reads(stopped.path, set(keys)) if keys and not stopped.overwritten else None
                    os.unlink(stopped.path)
        self.engine_answers += answers
        info["daemon_reads_during_engine_probes"] = witness
        self.attempts += [engine_attempt(a) for a in answers]
        self.attempts.append(Attempt("engine.daemon_trace", UNCLEAR if witness is None else READ if witness else MISSED,
                                     f"{witness} reads of the private prompt's keys hit"))  # fmt: skip
        if keys:
            info["held"] = held_by_admin(c.daemon.address, c.token, keys)
            for other in others:
                tok = c.creds.daemon[other]
                self.attempts += grpc_attempts(c.daemon.address, tok, keys)
                self.attempts.append(raw_attempt(c.daemon.address, tok, keys))
                self.attempts += shm_attempts(c.daemon.address, tok, keys)
        self.rounds.append(info)


def wait_daemon(cluster: Cluster, wait_s: float = 30.0) -> bool:
    """Until the daemon answers health (a round after a fault must not count the outage)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            with grpc.insecure_channel(cluster.daemon.address) as ch:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    return False
