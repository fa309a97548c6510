"""The soak's probes: calls without a valid token (every RPC and the raw stream channel), and
cross-tenant rounds — a tenant sends a private prompt twice, each other tenant then sends it once
on a replica that holds it, and must be told 0 cached tokens."""

from __future__ import annotations

import socket
import threading
import time

import grpc

from bench.soak.cluster import Cluster
from bench.soak.load import TENANTS, Answer, Load, private_prompt
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server import stream_wire as w
from kvstore.server.auth import ClientAuth

SERVICE = "/tierkv.kvstore.v1.KVStore/"


def unauthenticated_probe(address: str, token: str) -> tuple[int, int]:
    """(calls sent, calls served) with no token and a wrong one, on every RPC and the stream channel."""
    calls = [("Lookup", pb.LookupRequest(keys=[b"k" * 16])), ("Stats", pb.StatsRequest()),
             ("Delete", pb.DeleteRequest(keys=[b"k" * 16])), ("OpenStream", pb.OpenStreamRequest()),
             ("TraceStart", pb.TraceStartRequest()), ("TraceStop", pb.TraceStopRequest()),
             ("AttachShm", pb.AttachShmRequest(size=8192)),
             ("DetachShm", pb.DetachShmRequest(session="x")), ("ReleaseLease", pb.ReleaseLeaseRequest(session="x")),
             ("GetShm", pb.GetRequest(keys=[b"k" * 16], shm_session="x"))]  # fmt: skip
    sent = served = 0
    for ch in (grpc.insecure_channel(address), ClientAuth("wrong-" + "x" * 20).channel(address, [])):
        for method, req in [*calls, ("Get", pb.GetRequest(keys=[b"k" * 16])), ("Put", None)]:
            try:
                if method == "Get":
                    list(ch.unary_stream(SERVICE + method)(req.SerializeToString(), timeout=5))
                elif method == "Put":
                    ch.stream_unary(SERVICE + method)(iter([pb.PutRequest(commit=pb.PutCommit()).SerializeToString()]),
                                                      timeout=5)  # fmt: skip
                else:
                    ch.unary_unary(SERVICE + method)(req.SerializeToString(), timeout=5)
                sent, served = sent + 1, served + 1
            except grpc.RpcError as e:
                sent += e.code() != grpc.StatusCode.UNAVAILABLE  # the daemon is down: nothing was asked
        ch.close()
    try:  # the raw channel with a made-up token: closed without a byte
        port = _stream_port(address, token)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"\0" * w.TOKEN_BYTES + w.encode_request([b"k" * 16]))
            try:
                got = s.recv(1)
            except ConnectionResetError:  # closed with our request unread: nothing served
                got = b""
            sent, served = sent + 1, served + bool(got)
    except (OSError, grpc.RpcError):
        pass
    return sent, served


def _stream_port(address: str, token: str, wait_s: float = 15.0) -> int:
    """The raw channel's port, from an authenticated OpenStream (a slot frees when an unused token expires)."""
    good = ClientAuth(token).channel(address, [])
    try:
        deadline = time.monotonic() + wait_s
        while not (r := pb.OpenStreamResponse.FromString(good.unary_unary(SERVICE + "OpenStream")(b"", timeout=5))).ok:
            if time.monotonic() > deadline:
                raise OSError(f"no stream-channel slot: {r.reason}")
            time.sleep(0.1)
        return r.port
    finally:
        good.close()


class Probes:
    """Every ``every_s``: the unauthenticated probe, and one cross-tenant round (a tenant sends a
    private prompt twice; each other tenant then sends it once, on a replica that holds it)."""

    def __init__(self, cluster: Cluster, load: Load, words: int, seed: int) -> None:
        self.cluster, self.load, self.words, self.seed = cluster, load, words, seed
        self.unauth_sent = self.unauth_served = 0
        self.tenant_probes: list[Answer] = []
        self.reference: dict[str, str] = {}
        self.rounds = 0

    def once(self) -> None:
        sent, served = unauthenticated_probe(self.cluster.daemon.address, self.cluster.token)
        self.unauth_sent, self.unauth_served = self.unauth_sent + sent, self.unauth_served + served
        owner = TENANTS[self.rounds % len(TENANTS)]
        p = private_prompt(owner, self.rounds, self.words, self.seed)
        self.rounds += 1
        reps = self.load.replicas
        first = self.load.ask(p, owner, reps[0])
        if first.error is None and first.cached == 0:  # cold: a valid reference for this prompt
            self.reference[p.pid] = first.text
        self.load.ask(p, owner, reps[1 % len(reps)])  # hot on both replicas and in the daemon now
        for i, other in enumerate(t for t in TENANTS if t != owner):
            self.tenant_probes.append(self.load.ask(p, other, reps[i % len(reps)]))

    def run(self, stop: threading.Event, every_s: float) -> None:
        while not stop.wait(every_s):
            self.once()


# -- the run -------------------------------------------------------------------------------------
