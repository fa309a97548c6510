"""The fuzzer's daemon side: every gRPC handler (health included) and the raw stream channel.

Requests go out as raw bytes (a channel method with no serializer), so a case can be anything a
peer could send: a wild but well-typed message, a near-valid one, or bytes that are no message
at all. One case in ten goes without a token or with a wrong one: those must be refused
(UNAUTHENTICATED) and never served. Blocks the daemon returns are checked: a canary block stored
before the run must come back byte for byte, on every path, during and after the run.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2
from hypothesis import strategies as st

from bench.servers import spawn_daemon, stop_daemon
from bench.soak.fuzz import Tally, run_cases
from bench.soak.fuzz_cases import messages, put_streams, raw_or_mutated, stream_requests
from kvstore.block import decode_block, encode_block
from kvstore.client import shm_link
from kvstore.client.client import KVStoreClient
from kvstore.client.shm import HEADER_BYTES, ArenaMap, ShmSegment
from kvstore.errors import BlockFormatError
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server import stream_wire as w
from kvstore.server.auth import ClientAuth

SERVICE = "/tierkv.kvstore.v1.KVStore/"
HEALTH = "/grpc.health.v1.Health/"
HANDLERS = ("Lookup", "Put", "Get", "GetShm", "Delete", "Stats", "AttachShm", "DetachShm", "ReleaseLease",
            "TraceStart", "TraceStop", "OpenStream", "Health.Check", "Health.Watch")  # fmt: skip
REQUESTS = {"GetShm": pb.GetRequest}  # a handler whose request type is not named after it
CLEAR = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "DATA_LOSS",
         "OUT_OF_RANGE", "UNAUTHENTICATED", "UNIMPLEMENTED"}  # fmt: skip
CRASH_LOG_LINES = ("Exception calling application", "Exception iterating responses", "Traceback")
SEG_BYTES = 1 << 20


def _canary(i: int) -> tuple[bytes, bytes]:
    key = b"fuzz-canary-%04d" % i
    return key, encode_block(key, np.random.default_rng(i).standard_normal(2048).astype(np.float32), layout="T")


def _read(c: KVStoreClient, keys: list[bytes]) -> list[bytes | None]:
    """Each block's bytes (None for a miss), copied out of the client's read."""
    out: list[bytes | None] = [None] * len(keys)

    def keep(items: list[tuple[int, memoryview]]) -> None:
        for i, mv in items:
            out[i] = bytes(mv)

    c.read_batches(keys, keep)
    return out


class GrpcFuzzer:
    def __init__(self, address: str, token: str, work: Path, deadline_s: float = 10.0,
                 log_path: Path | None = None) -> None:  # fmt: skip
        opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
        self.address, self.deadline_s, self.log_path = address, deadline_s, log_path
        self.auth = {"good": ClientAuth(token).channel(address, opts), "none": grpc.insecure_channel(address, opts),
                     "wrong": ClientAuth("w" + secrets.token_hex(12)).channel(address, opts)}  # fmt: skip
        self.trace_dir = work / "traces"
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        self.canaries = dict(_canary(i) for i in range(4))
        self.client_auth = ClientAuth(token)
        self.client = KVStoreClient(address, auth=self.client_auth, deadline_s=deadline_s, use_shm=False)
        self.client.put_many(list(self.canaries.items()))
        self.seg = ShmSegment.create(SEG_BYTES)
        resp = pb.AttachShmResponse.FromString(self.auth["good"].unary_unary(SERVICE + "AttachShm")(
            pb.AttachShmRequest(size=self.seg.size, arena=True, by_fd=True).SerializeToString(), timeout=deadline_s))
        self.session, self.arena = self._hand_over(resp)  # blocks a Get answers in place are checked in the arena
        self._stream_port = self._token()[0]  # where connections without a valid token go
        self.tally = Tally()

    def __enter__(self) -> GrpcFuzzer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.client.close()
        for ch in self.auth.values():
            ch.close()
        self.seg.close()
        if self.arena is not None:
            self.arena.close()

    def _hand_over(self, resp: pb.AttachShmResponse) -> tuple[str, ArenaMap | None]:
        """Our segment's fd to the daemon's unix socket: (the session, the arena mapped, if given)."""
        if not resp.ok or self.seg.fd is None:
            return "", None
        try:
            link, welcome, arena_fd = shm_link.join(resp.socket, resp.ticket, self.seg.fd, self.seg.size,
                                                    self.deadline_s)  # fmt: skip
        except (OSError, ValueError):
            return "", None
        self.seg.link = link
        self.seg.handed_over()
        try:
            arena = ArenaMap(arena_fd, welcome.arena_size, welcome.arena_token) if arena_fd is not None else None
        except (OSError, ValueError):
            arena = None
        return (welcome.session if welcome.ok else ""), arena

    # -- running ---------------------------------------------------------------------------
    def run(self, shares: dict[str, int], seed: int) -> Tally:
        """Each handler's share of cases (the stream channel before OpenStream: its tokens hold
        slots), then the after-checks: canaries intact, a fresh round trip, no crash in the log."""
        order = ["stream", *[h for h in HANDLERS if h in shares]]
        for i, target in enumerate(t for t in order if t in shares):
            strategy, body = self._target(target)
            run_cases(strategy, shares[target], seed + i, body, self.tally, target)
        self._after()
        return self.tally

    def _target(self, name: str) -> tuple[st.SearchStrategy[object], Callable[[object], None]]:
        if name == "stream":
            return stream_requests(list(self.canaries)), self._stream_case  # type: ignore[return-value]
        auth = st.sampled_from(["good"] * 18 + ["none", "wrong"])
        return st.tuples(auth, self._payloads(name)), lambda c: self._grpc_case(name, *c)  # type: ignore[misc]

    def _payloads(self, name: str) -> st.SearchStrategy[object]:
        if name == "Put":
            return put_streams(self.session, self.seg.size)
        if name.startswith("Health."):
            svc = st.one_of(st.sampled_from(["", "tierkv.kvstore.v1.KVStore", "tierkv.tier.cpu", "tierkv.tier."]),
                            st.text(max_size=40))  # fmt: skip
            return raw_or_mutated(svc.map(lambda s: health_pb2.HealthCheckRequest(service=s).SerializeToString()))
        if name == "TraceStart":
            return raw_or_mutated(self._trace_starts()).map(self._safe_trace)
        if name == "AttachShm":
            near = st.builds(lambda size, arena, by_fd: pb.AttachShmRequest(size=size, arena=arena, by_fd=by_fd),
                             st.sampled_from([self.seg.size, 0, HEADER_BYTES, self.seg.size + 1, 2**64 - 1]),
                             st.booleans(), st.booleans())  # fmt: skip
            return raw_or_mutated(st.one_of(near, messages(pb.AttachShmRequest.DESCRIPTOR)).map(_ser))
        desc = REQUESTS.get(name, getattr(pb, f"{name}Request", None)).DESCRIPTOR
        wild = messages(desc)
        if name in ("Get", "GetShm"):
            wild = st.tuples(wild, st.booleans(), st.lists(st.sampled_from(list(self.canaries)), max_size=3)).map(
                self._near_get)
        return st.one_of(wild.map(_ser), raw_or_mutated(wild.map(_ser)))

    def _near_get(self, c: tuple[pb.GetRequest, bool, list[bytes]]) -> pb.GetRequest:
        """With our session, half the time with a region that is really in our segment and keys
        the daemon accepts (so the call gets as far as writing blocks)."""
        msg, shm, canaries = c
        msg.keys.extend(canaries)
        if shm and self.session:
            msg.shm_session = self.session
            if len(canaries) % 2 == 0:
                msg.shm_offset, msg.shm_length = HEADER_BYTES, self.seg.size - HEADER_BYTES
                kept = [k for k in msg.keys if 0 < len(k) <= 256]
                del msg.keys[:]
                msg.keys.extend(kept)
        return msg

    def _trace_starts(self) -> st.SearchStrategy[bytes]:
        d = str(self.trace_dir)
        out = st.one_of(st.just(""), st.text(max_size=20), st.uuids().map(lambda u: f"{d}/{u.hex}.kvtrace"),
                        st.sampled_from([d, f"{d}/no/such/dir/x", f"{d}/" + "a" * 300, f"{d}/a\x00b",
                                         "/" + "b" * 5000, "relative/x"]))  # fmt: skip
        limit = st.one_of(st.sampled_from([0, 1, 2, 100_000_001, 2**32, 2**64 - 1]), st.integers(0, 100_000))
        return st.builds(lambda o, m: pb.TraceStartRequest(out=o, max_records=m).SerializeToString(), out, limit)

    def _safe_trace(self, payload: bytes) -> bytes:
        """A TraceStart that would have the daemon write a file outside the fuzz directory (a
        truncated or flipped path such as "/tm") is sent with that path dropped: an
        authenticated caller chooses the file, and the fuzzer runs as whoever started it."""
        try:
            out = pb.TraceStartRequest.FromString(payload).out
        except Exception:  # noqa: BLE001 - not a message: the daemon refuses it before any file
            return payload
        inside = os.path.normpath(out).startswith(str(self.trace_dir) + os.sep) or not out.startswith("/")
        return payload if inside or "\x00" in out or len(out) > 255 else b""

    # -- one gRPC case -------------------------------------------------------------------------
    def _grpc_case(self, name: str, auth: str, payload: object) -> None:
        ch = self.auth[auth]
        method = (HEALTH + name.split(".")[1]) if name.startswith("Health.") else SERVICE + name
        code, details, got = "OK", "", None
        try:
            if name == "Put":
                for off, data in payload.place:  # type: ignore[attr-defined]
                    self.seg.buf[off : off + len(data)] = data
                got = ch.stream_unary(method)(iter(payload.messages), timeout=self.deadline_s)  # type: ignore[attr-defined]
            elif name in ("Get", "Health.Watch"):
                call = ch.unary_stream(method)(payload, timeout=self.deadline_s)
                got = [next(call)] if name == "Health.Watch" else list(call)
                call.cancel()
            else:
                got = ch.unary_unary(method)(payload, timeout=self.deadline_s)
        except StopIteration:
            code, details = "NO_MESSAGE", "Watch ended without a first message"
        except grpc.RpcError as e:
            code, details = e.code().name, e.details() or ""
        why = None
        if code not in CLEAR:
            why = f"{code}: {details}"
        elif code != "OK" and not details:
            why = f"{code} without a message"
        elif auth != "good" and not name.startswith("Health.") and code not in ("UNAUTHENTICATED", "RESOURCE_EXHAUSTED"):
            self.tally.unauthenticated_accepted += 1
            why = f"{auth} token, yet answered {code}"
        elif code == "OK" and name in ("Get", "GetShm"):
            why = self._check_get(payload, got if name == "Get" else [got])  # type: ignore[arg-type,list-item]
        self.tally.record(name, code, why, payload)
        if code == "OK" and name == "TraceStart":  # the file is written at stop: that is a case too
            self._grpc_case("TraceStop", "good", b"")

    def _check_get(self, payload: bytes, resps: list[bytes]) -> str | None:
        """Blocks served for a canary key are the canary's bytes (streamed or through shared memory)."""
        try:
            req = pb.GetRequest.FromString(payload)
        except Exception:  # noqa: BLE001 - the daemon parsed it differently? then it could not have answered
            return "answered a request that does not parse"
        parts: dict[int, bytearray] = {}
        for raw in resps:
            r = pb.GetResponse.FromString(raw)
            for b in r.shm:
                if b.found and not b.deferred and b.index < len(req.keys) and req.keys[b.index] in self.canaries:
                    got = self._shm_bytes(b)
                    if got is not None and got != self.canaries[req.keys[b.index]]:
                        where = "the daemon's arena" if b.arena else "our segment"
                        return f"shared-memory get of canary {req.keys[b.index]!r}: wrong bytes in {where}"
            if r.lease and self.session:  # unpin what was answered in place (an unreleased lease only expires)
                self.auth["good"].unary_unary(SERVICE + "ReleaseLease")(pb.ReleaseLeaseRequest(
                    session=self.session, leases=[r.lease]).SerializeToString(), timeout=self.deadline_s)  # fmt: skip
            if r.found:
                buf = parts.setdefault(r.index, bytearray(r.total))
                buf[r.offset : r.offset + len(r.data)] = r.data
        for i, data in parts.items():
            k = req.keys[i] if i < len(req.keys) else None
            if k in self.canaries and bytes(data) != self.canaries[k]:
                return f"streamed get of canary {k!r}: wrong bytes"
        return None

    def _shm_bytes(self, b: pb.ShmBlock) -> bytes | None:
        """The bytes a handle points at: in the daemon's arena (None if we could not map it) or our segment."""
        if b.arena:
            return bytes(self.arena.view(b.offset, b.length)) if self.arena is not None else None
        return bytes(self.seg.buf[b.offset : b.offset + b.length])

    # -- one stream-channel case ---------------------------------------------------------------
    def _token(self) -> tuple[int, bytes]:
        deadline = time.monotonic() + 30
        while True:
            r = pb.OpenStreamResponse.FromString(self.auth["good"].unary_unary(SERVICE + "OpenStream")(
                b"", timeout=self.deadline_s))  # fmt: skip
            if r.ok or time.monotonic() > deadline:
                return r.port, r.token
            time.sleep(0.02)

    def _stream_case(self, case: tuple[bool, bytes]) -> None:
        good, body = case
        port, token = self._token() if good else (self._stream_port, b"\0" * w.TOKEN_BYTES)  # a token unused holds a slot
        if not port:
            self.tally.record("stream", "no-slot", "OpenStream found no free slot within 30 s", case)
            return
        data, why = b"", None
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=self.deadline_s) as s:
                s.sendall(token + body)
                s.shutdown(socket.SHUT_WR)  # all sent: the daemon sees the end of our request
                chunks = []
                while chunk := s.recv(1 << 20):
                    chunks.append(chunk)
                data = b"".join(chunks)
        except TimeoutError:
            why = f"no end of reply within {self.deadline_s} s"
        except OSError:
            pass  # closed on us after a refusal (reset, broken pipe, not connected): a clear end
        if why is None:
            why = self._check_frames(data) if good else (None if not data else "served without a valid token")
            if not good and data:
                self.tally.unauthenticated_accepted += 1
        self.tally.record("stream", "ok" if why is None else "bad", why, case)

    def _check_frames(self, data: bytes) -> str | None:
        pos = 0
        while pos < len(data):
            if pos + w.FRAME.size > len(data):
                return f"frame header cut at byte {pos}"
            kind, n = w.FRAME.unpack_from(data, pos)
            pos += w.FRAME.size
            if kind in (w.MISS, w.DONE) and n == 0:
                continue
            if pos + n > len(data):
                return f"frame of kind {kind} cut: {n} bytes announced"
            body, pos = data[pos : pos + n], pos + n
            if kind == w.FOUND:
                try:
                    blk = decode_block(body)
                except BlockFormatError as e:
                    return f"served a block that does not decode: {e}"
                if blk.key in self.canaries and body != self.canaries[blk.key]:
                    return f"canary {blk.key!r}: wrong bytes"
            elif kind in (w.ERR_INVALID, w.ERR_UNAVAILABLE, w.ERR_EXHAUSTED) and n and pos == len(data):
                continue
            else:
                return f"unexpected frame kind {kind} ({n} bytes) {body[:80]!r}"
        return None

    # -- after the run ---------------------------------------------------------------------------
    def _after(self) -> None:
        why = None
        try:
            for use_shm in (True, False):
                with KVStoreClient(self.address, auth=self.client_auth, deadline_s=self.deadline_s,
                                   use_shm=use_shm) as c:  # fmt: skip
                    if _read(c, list(self.canaries)) != list(self.canaries.values()):
                        why = f"canaries changed (shm={use_shm})"
                    k, v = _canary(99)
                    c.put(k, v)
                    if _read(c, [k]) != [v]:
                        why = "a fresh put/get round trip returned other bytes"
        except Exception as e:  # noqa: BLE001
            why = f"daemon no longer serves: {type(e).__name__}: {e}"
        self.tally.record("after", "ok" if why is None else "bad", why)
        if self.log_path is not None and self.log_path.exists():
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines()
                     if any(m in ln for m in CRASH_LOG_LINES)]  # fmt: skip
            for ln in lines:
                self.tally.record("log", "bad", f"daemon log: {ln[:300]}")


def _ser(m: object) -> bytes:
    return m.SerializeToString()  # type: ignore[attr-defined]


@contextmanager
def fuzz_daemon(work: Path, *flags: str) -> Iterator[tuple[str, str, Path]]:
    """A ``kvstore serve`` (cpu over disk, auth on, its own token) to fuzz: (address, token, log)."""
    token = secrets.token_urlsafe(24)
    log = work / "fuzz-daemon.log"
    proc, address = spawn_daemon(work / "cache", "--cpu", "64Mi", "--disk", f"{work}/disk:256Mi",
                                 "--traces-dir", str(work / "traces"), *flags,  # where GrpcFuzzer's TraceStarts go
                                 env={"TIERKV_TOKEN": token}, log_path=log)  # fmt: skip
    try:
        yield address, token, log
    finally:
        stop_daemon(proc)

