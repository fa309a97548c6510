"""The engine's gate: a process of its own that takes the HTTP API's connections, refuses what it can
without the engine, and hands everything else to the engine over a unix socket.

    python -m engine.gate --listen HOST:PORT --upstream SOCKET --max-body N [--api-keys FILE]

``kvengine serve --gate on`` starts it (``GateProcess``) and serves its own API on ``SOCKET`` only;
``--gate off`` serves on the port from the engine's process. ``auto`` (the default): on where the
engine's process has at least ``SPARE_CPUS`` CPUs beyond its compute threads (``wanted``), off where
it has not.

Why a process: the engine's HTTP side shares one interpreter with the step loop, and the interpreter
lock it holds is time the step thread waits. A flood of refused requests (bench.soak's
``dos.stop_strings`` and ``dos.prompt_16mib``: 16 MB bodies, each answered 413 from its
Content-Length) cost the engine ~0.4 ms of its interpreter each, ~450 a second, and held another
tenant's stream at 1.5-1.6x its ITL p99 (issue #22's target: 1.5x) with the C HTTP stack; a lower
switch interval did not change it. Here those refusals never reach the engine's interpreter.

Why not always: the gate is a process, and it needs a core. ``python -m bench.http_stack --pin``
(the engine on a core of its own; the gate, the attackers and the stream's client on the other;
3 reps of 30 s, bench/results/http_stack_pinned.json): under the flood the stream's ITL p50 was
1.07x its own with the gate and 1.23x without, its p99 79 ms against 102 ms (the p99 ratios, 1.29x
and 1.28x, are within the spread of the windows alone: 61-94 ms), and the engine spent 6 us of CPU
per refusal against 328 us. Unpinned on this 2-core machine, where the engine's thread, the gate and
the attackers share both cores, the gate lost (quick run: p99 1.59x against 1.25x, p50 1.75x against
1.21x): its CPU is the engine's. Hence ``auto``.

What the gate answers itself, as the engine would (the same status, OpenAI-shaped body and headers),
then closes the connection without reading the rest:

- 413: a body whose Content-Length is past the engine's body bound (engine/limits.py
  ``body_bytes_limit``), or a chunked body as soon as it passes it;
- 401: with API keys, a request to any path but /health and /metrics without a valid key;
- 431: a request head over ``HEAD_BYTES``; 400: a request that is not HTTP/1.x;
- 503 with Retry-After: the engine's socket does not answer (starting, or shutting down).

A connection whose request head is not complete within ``HEAD_TIMEOUT_S`` is closed (slow heads hold
nothing in the engine). Past ``MAX_CONNECTIONS`` open connections a new one is answered 503.

Everything else goes to the engine as parsed: the head as received (method, target, version,
headers in order), the body as is or chunk by chunk; one engine connection per client connection, so
answers come back in order as bytes, untouched. Back-pressure both ways: a full engine socket pauses
reading the client, a slow client pauses reading the engine. A client that goes away closes its
engine connection, which aborts its request there. The engine's own checks all still apply (the
gate is a filter, not the authority: a request it lets through is judged by the engine as before).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httptools

from engine.limits import declared_past, too_large
from engine.tenancy import MISSING_KEY, OPEN_PATHS, ApiKeys

log = logging.getLogger("engine.gate")

KEYLESS = frozenset(p.encode() for p in OPEN_PATHS)  # engine/tenancy.py OPEN_PATHS, as the parser's bytes
HEAD_BYTES = 64 << 10  # request line and headers of one request
HEAD_TIMEOUT_S = 10.0  # from a connection's (or request's) first byte to the end of its head
MAX_CONNECTIONS = 4096
CONNECT_TRIES_S = 2.0  # how long a request waits for the engine's socket before its 503
HIGH_WATER = 1 << 20  # bytes queued toward the engine before reading the client pauses
SPARE_CPUS = 2  # ``auto``: CPUs beyond the engine's compute threads (one for the gate, one for the rest)
MODES = ("auto", "on", "off")
READY = b"gate ready\n"  # written to stdout once listening: kvengine serve waits for it


def available_cpus(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota (a container's
    ``resources.limits.cpu``, which the affinity does not show), rounded up."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = Path(cpu_max).read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cpus


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound and listening on ``host:port`` (IPv4 or IPv6); OSError when the address is
    taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def wanted(mode: str, cpus: int, compute_threads: int) -> bool:
    """Whether ``kvengine serve`` puts the gate in front: ``on``/``off`` as said; ``auto`` where the
    process may run on ``SPARE_CPUS`` more CPUs than its compute threads keep busy."""
    if mode not in MODES:
        raise ValueError(f"--gate must be one of {', '.join(MODES)}, got {mode!r}")
    return mode == "on" or (mode == "auto" and cpus - compute_threads >= SPARE_CPUS)


def _answer(status: int, reason: str, message: str, etype: str, extra: dict[str, str] | None = None) -> bytes:
    body = json.dumps({"error": {"message": message, "type": etype, "param": None, "code": None}}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(body)}",
            "connection: close", *(f"{k}: {v}" for k, v in (extra or {}).items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def too_large_answer(max_body: int, size: int | None = None) -> bytes:
    """The engine's 413 (engine/limits.py ``too_large``), as bytes on the wire, the connection closed."""
    return _answer(413, "Content Too Large", too_large(max_body, size), "invalid_request_error")


UNAUTHORIZED = _answer(401, "Unauthorized", MISSING_KEY, "authentication_error", {"www-authenticate": "Bearer"})
HEAD_TOO_LARGE = _answer(431, "Request Header Fields Too Large",
                         f"the request line and headers are longer than {HEAD_BYTES} bytes", "invalid_request_error")
BAD_REQUEST = _answer(400, "Bad Request", "malformed HTTP/1.x request", "invalid_request_error")
UNAVAILABLE = _answer(503, "Service Unavailable", "the engine is not taking requests (starting or stopping)",
                      "server_error", {"retry-after": "1"})
NO_UPGRADE = _answer(400, "Bad Request", "protocol upgrades (websocket, h2c) are not served", "invalid_request_error")
BUSY = _answer(503, "Service Unavailable", f"more than {MAX_CONNECTIONS} connections are open", "server_error",
               {"retry-after": "1"})


class Gate:
    """The settings of one gate and its open connections."""

    def __init__(self, upstream: str, max_body: int, api_keys: ApiKeys | None) -> None:
        self.upstream, self.max_body, self.api_keys = upstream, max_body, api_keys
        self.open: set[_Client] = set()


class _Upstream(asyncio.Protocol):
    """The engine's side of one client connection: its bytes go back to the client as they are."""

    def __init__(self, client: _Client) -> None:
        self.client = client

    def data_received(self, data: bytes) -> None:
        if self.client.closed:  # refused or gone: nothing more goes to it
            return
        self.client.answered = True
        self.client.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.upstream_lost()

    def pause_writing(self) -> None:  # the engine reads slower than the client sends
        self.client.transport.pause_reading()

    def resume_writing(self) -> None:
        if not self.client.transport.is_closing():
            self.client.transport.resume_reading()


class _Client(asyncio.Protocol):
    """One client connection: parsed with httptools (C), checked at the end of each request head,
    forwarded to its own engine connection."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.up: asyncio.Transport | None = None
        self.pending: list[bytes] | None = None  # while the engine connection is being made
        self.pending_bytes = 0
        self.closed = False
        self.answered = False  # has the engine sent anything since the current request's head went to it?
        self._timer: asyncio.TimerHandle | None = None
        self._begin()

    def _begin(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_bytes = 0
        self.chunked = False
        self.body_bytes = 0

    # -- connection ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if len(self.gate.open) >= MAX_CONNECTIONS:
            self._refuse(BUSY)
            return
        self.gate.open.add(self)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.gate.open.discard(self)
        self._disarm()
        if self.up is not None:
            self.up.close()  # the engine sees its client go: an unfinished request is aborted

    def pause_writing(self) -> None:  # the client reads slower than the engine answers
        if self.up is not None:
            self.up.pause_reading()

    def resume_writing(self) -> None:
        if self.up is not None and not self.up.is_closing():
            self.up.resume_reading()

    def upstream_lost(self) -> None:
        """The engine closed its side (it answered ``connection: close``, or it stopped): so do we,
        once what it sent is written."""
        self.up = None
        if not self.closed:
            self.closed = True
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade):  # upgrade: a CONNECT, say
            if not self.closed:
                self._refuse(BAD_REQUEST)

    # -- timers ----------------------------------------------------------------------------
    def _arm(self) -> None:
        self._disarm()
        self._timer = asyncio.get_running_loop().call_later(HEAD_TIMEOUT_S, self._head_timeout)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _head_timeout(self) -> None:
        self._timer = None
        if not self.closed:
            self.closed = True
            self.transport.abort()

    # -- httptools callbacks ---------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._begin()
        if self.up is None:  # between keep-alive requests the engine's own idle timeout closes us
            self._arm()

    def on_url(self, url: bytes) -> None:
        self.url += url
        self._count(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        self._count(len(name) + len(value) + 4)

    def _count(self, n: int) -> None:
        self.head_bytes += n
        if self.head_bytes > HEAD_BYTES and not self.closed:
            self._refuse(HEAD_TOO_LARGE)
            raise httptools.HttpParserError("head too large")  # stop parsing this connection's bytes

    def on_headers_complete(self) -> None:
        if self.closed:
            return
        self._disarm()
        declared, auth = None, None
        for name, value in self.headers:
            lname = name.lower()
            if lname == b"content-length":
                declared = value
            elif lname == b"transfer-encoding" and b"chunked" in value.lower():
                self.chunked = True
            elif lname == b"authorization":
                auth = value
        if (size := declared_past(declared, self.gate.max_body)) is not None:
            self._refuse(too_large_answer(self.gate.max_body, size))
            return
        keys = self.gate.api_keys
        if keys is not None and self.url.split(b"?", 1)[0] not in KEYLESS \
                and keys.tenant(auth.decode("latin-1") if auth is not None else None) is None:
            self._refuse(UNAUTHORIZED)
            return
        if self.parser.should_upgrade():
            self._refuse(NO_UPGRADE)
            return
        version = self.parser.get_http_version()
        self.answered = False
        head = [self.parser.get_method() + b" " + self.url + b" HTTP/" + version.encode()]
        head += [name + b": " + value for name, value in self.headers]
        self._send(b"\r\n".join(head) + b"\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self.closed:
            return
        self.body_bytes += len(body)
        if self.body_bytes > self.gate.max_body:  # a chunked body past the bound (a declared one stops above)
            self._refuse(too_large_answer(self.gate.max_body), forwarded=True)
            return
        self._send(b"%x\r\n%b\r\n" % (len(body), body) if self.chunked else body)

    def on_message_complete(self) -> None:
        if self.closed:
            return
        if self.chunked:
            self._send(b"0\r\n\r\n")

    # -- to the engine -----------------------------------------------------------------------
    def _send(self, data: bytes) -> None:
        if self.up is not None:
            if not self.up.is_closing():
                self.up.write(data)
            return
        if self.pending is None:
            self.pending = []
            asyncio.get_running_loop().create_task(self._connect())
        self.pending.append(data)
        self.pending_bytes += len(data)
        if self.pending_bytes > HIGH_WATER:
            self.transport.pause_reading()

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CONNECT_TRIES_S
        while not self.closed:
            try:
                up, _ = await loop.create_unix_connection(lambda: _Upstream(self), self.gate.upstream)
                break
            except OSError:
                if loop.time() > deadline:
                    self._refuse(UNAVAILABLE)
                    return
                await asyncio.sleep(0.02)
        else:
            return
        if self.closed:
            up.close()
            return
        self.up = up  # type: ignore[assignment]
        for data in self.pending or ():
            up.write(data)  # type: ignore[attr-defined]
        self.pending, self.pending_bytes = None, 0
        self.transport.resume_reading()

    # -- refusals ----------------------------------------------------------------------------
    def _refuse(self, answer: bytes, forwarded: bool = False) -> None:
        """Answer and close, the rest of the request unread (the kernel drops it). ``forwarded``: the
        request's head already went to the engine, which may have started its own answer."""
        self.closed = True
        self._disarm()
        if not (forwarded and self.answered):  # never into the middle of the engine's answer
            self.transport.write(answer)
        self.transport.close()
        if self.up is not None:
            self.up.close()


async def serve(gate: Gate, host: str, port: int, ready: Callable[[asyncio.AbstractServer], None] | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Serve until ``stop`` is set (None: until SIGTERM or SIGINT), then wait for the open connections."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(gate), sock=listening_socket(host, port))
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready(server)
    await stop.wait()
    server.close()  # no new connections; the open ones end as the engine ends them
    for c in list(gate.open):
        if c.up is None and c.pending is None:  # nothing of it with the engine: nothing to wait for
            c.transport.close()
    while gate.open:
        await asyncio.sleep(0.05)


def _die_with_parent(parent: int) -> None:
    """SIGTERM when the process that started us ends, however it ends (a SIGKILLed engine included)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        sys.exit(0)


class GateProcess:
    """The engine's side: starts the gate on ``host:port`` in front of a unix socket in a private
    directory (0700) for the engine's own server (``socket``), waits until it listens, starts it again
    if it dies while the engine serves, and stops it. ``start`` raises ConfigError with the gate's
    reason (the port taken, an unreadable keys file) when it cannot listen."""

    START_TIMEOUT_S = 30.0
    RESPAWN_WAIT_S = 1.0

    def __init__(self, host: str, port: int, max_body: int, api_keys_file: str = "") -> None:
        self._dir = tempfile.mkdtemp(prefix="tierkv-engine-")  # 0700: only this user reaches the socket
        self.socket = os.path.join(self._dir, "api.sock")
        self.host, self.port, self.max_body, self.api_keys_file = host, port, max_body, api_keys_file
        self.proc: subprocess.Popen[bytes] | None = None
        self._stopping = False

    def _spawn(self) -> subprocess.Popen[bytes]:
        listen = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        argv = [sys.executable, "-m", "engine.gate", "--listen", listen, "--upstream", self.socket,
                "--max-body", str(self.max_body), "--api-keys", self.api_keys_file, "--parent", str(os.getpid())]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        assert proc.stdout is not None
        line = _read_line(proc.stdout, self.START_TIMEOUT_S)
        if not line.startswith(READY.decode().rstrip()):
            proc.kill()
            code = proc.wait()
            from engine.errors import ConfigError

            raise ConfigError(f"the engine's gate did not start on {listen} (exit {code}; its reason is logged above)")
        self.port = int(line.split()[-1])  # the port it bound (the one asked for, or the kernel's for 0)
        return proc

    def start(self) -> None:
        self.proc = self._spawn()
        threading.Thread(target=self._keep, name="gate-watch", daemon=True).start()

    def _keep(self) -> None:
        """Start the gate again if it dies while the engine serves: a crash there must not take the
        API down for good (nor the engine: the engine's state is all here)."""
        while not self._stopping and self.proc is not None:
            code = self.proc.wait()
            if self._stopping:
                return
            log.error("the engine's gate (pid %d) exited with %s; starting it again", self.proc.pid, code)
            time.sleep(self.RESPAWN_WAIT_S)
            try:
                self.proc = self._spawn()
            except Exception as e:  # noqa: BLE001 - keep trying: the port may be free again later
                log.error("the engine's gate did not start again: %s", e)

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM (no new connections; the open ones end as the engine ends them), SIGKILL after
        ``timeout_s``; the socket's directory removed."""
        self._stopping = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        import shutil

        shutil.rmtree(self._dir, ignore_errors=True)


def _read_line(stream: object, timeout_s: float) -> str:
    """One line of a child's stdout, or "" if none within ``timeout_s`` (or it closed)."""
    import select

    fd = stream.fileno()  # type: ignore[attr-defined]
    buf = b""
    deadline = time.monotonic() + timeout_s
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return ""
        chunk = os.read(fd, 256)
        if not chunk:
            return ""
        buf += chunk
    return buf.decode(errors="replace").strip()


def main(argv: list[str] | None = None) -> int:
    from engine.cli import host_port

    p = argparse.ArgumentParser(prog="python -m engine.gate", description=__doc__.split("\n")[0])
    p.add_argument("--listen", required=True, help="HOST:PORT of the API")
    p.add_argument("--upstream", required=True, help="the engine's unix socket")
    p.add_argument("--max-body", type=int, required=True, help="bytes of one request body")
    p.add_argument("--api-keys", default="", help="the engine's API keys file")
    p.add_argument("--parent", type=int, default=0, help="exit when this process does")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.parent:
        _die_with_parent(a.parent)
    host, port = host_port(a.listen, "--listen")
    gate = Gate(a.upstream, a.max_body, ApiKeys.load(a.api_keys) if a.api_keys else None)
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:
        runner = asyncio.run

    def ready(server: asyncio.AbstractServer) -> None:
        bound = server.sockets[0].getsockname()[1]
        sys.stdout.buffer.write(READY.replace(b"\n", f" {bound}\n".encode()))
        sys.stdout.flush()

    try:
        runner(serve(gate, host, port, ready))
    except OSError as e:
        print(f"kvengine gate: cannot listen on {host}:{port}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
