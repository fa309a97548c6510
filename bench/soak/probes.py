"""The soak's probes, every ``every_s`` while the load runs: calls without a valid token (every RPC
and the raw stream channel), a cross-tenant round through every path (bench/soak/tenant_probes.py)
and a forgery in Redis or S3 (bench/soak/forge.py). Each round first waits for the daemon to answer
health, so a fault in progress is not taken for an answer."""

from __future__ import annotations

import socket
import threading
import time

import grpc

from bench.soak.cluster import Cluster
from bench.soak.forge import Forger
from bench.soak.load import TENANTS, Load, private_prompt
from bench.soak.security_figures import auth_refused
from bench.soak.tenancy import PROBE
from bench.soak.tenant_probes import CrossTenant, wait_daemon
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server import stream_wire as w
from kvstore.server.auth import ClientAuth

SERVICE = "/tierkv.kvstore.v1.KVStore/"


def unauthenticated_probe(address: str, token: str) -> tuple[int, int, int]:
    """(calls sent, calls served, calls answered with an error that is no refusal) with no token and
    a wrong one, on every RPC and the stream channel. Only UNAUTHENTICATED / PERMISSION_DENIED refuse."""
    calls = [("Lookup", pb.LookupRequest(keys=[b"k" * 16])), ("Stats", pb.StatsRequest()),
             ("Delete", pb.DeleteRequest(keys=[b"k" * 16])), ("OpenStream", pb.OpenStreamRequest()),
             ("TraceStart", pb.TraceStartRequest()), ("TraceStop", pb.TraceStopRequest()),
             ("AttachShm", pb.AttachShmRequest(size=8192)),
             ("DetachShm", pb.DetachShmRequest(session="x")), ("ReleaseLease", pb.ReleaseLeaseRequest(session="x")),
             ("GetShm", pb.GetRequest(keys=[b"k" * 16], shm_session="x"))]  # fmt: skip
    sent = served = other = 0
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
                sent, other = sent + 1, other + (not auth_refused(e.code()))
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
    return sent, served, other


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
    """Every ``every_s``: the unauthenticated probe, a cross-tenant round (the probe tenant sends a
    private prompt twice; each load tenant then tries to read it by every path) and a forgery."""

    def __init__(self, cluster: Cluster, load: Load, words: int, seed: int) -> None:
        self.cluster, self.load, self.words, self.seed = cluster, load, words, seed
        self.unauth_sent = self.unauth_served = self.unauth_other = 0
        self.cross = CrossTenant(cluster, load)
        self.forger = Forger(cluster, load, words, seed)
        self.rounds = 0
        self.skipped = 0  # rounds the daemon was not back for

    @property
    def tenant_probes(self) -> list:  # type: ignore[type-arg]
        return self.cross.engine_answers

    @property
    def reference(self) -> dict[str, str]:
        return self.cross.reference

    def once(self) -> None:
        if not wait_daemon(self.cluster):
            self.skipped += 1
            return
        sent, served, other = unauthenticated_probe(self.cluster.daemon.address, self.cluster.token)
        self.unauth_sent += sent
        self.unauth_served += served
        self.unauth_other += other
        k = self.rounds
        self.rounds += 1
        self.cross.round(private_prompt(PROBE, k, self.words, self.seed), list(TENANTS))
        self.forger.once(k)

    def run(self, stop: threading.Event, every_s: float) -> None:
        while not stop.wait(every_s):
            self.once()
