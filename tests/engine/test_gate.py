"""engine/gate.py: the process in front of the engine's HTTP API. Here the gate's server runs on an
event loop of its own (a thread) in front of a small ASGI app served by uvicorn on a unix socket, the
way ``kvengine serve`` puts the engine's server behind it; the app records what reached it.

Each refusal is checked twice: the client gets the engine's answer, and the app never saw the
request (what the gate is for: the engine's interpreter spends nothing on it)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from engine import gate as gate_mod
from engine.errors import ConfigError
from engine.gate import Gate, GateProcess, serve
from engine.tenancy import ApiKeys

KEY = "k" * 24
MAX_BODY = 4096


class App:
    """The engine's stand-in: /echo answers what it read, /stream sends ``n`` events on request, /health."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []  # (method, path) of every request that reached it
        self.disconnected = threading.Event()
        self.release = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.seen.append((scope["method"], scope["path"]))
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        headers = dict(scope["headers"])
        if scope["path"] == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
            for i in range(int(json.loads(body)["n"])):
                await send({"type": "http.response.body", "body": f"data: {i}\n\n".encode(), "more_body": True})
                await asyncio.sleep(0.05)
                if i == 0:
                    try:
                        await asyncio.wait_for(receive(), 0.01)  # an http.disconnect if the client left
                        self.disconnected.set()
                        return
                    except TimeoutError:
                        pass
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
            return
        out = json.dumps({"path": scope["path"], "query": scope["query_string"].decode(), "bytes": len(body),
                          "body": body[:64].decode(errors="replace"),
                          "auth": headers.get(b"authorization", b"").decode(),
                          "chunked": headers.get(b"transfer-encoding", b"").decode()}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": out})


class Running:
    def __init__(self, tmp: Path, api_keys: ApiKeys | None, upstream_up: bool = True) -> None:
        self.app = App()
        self.sock = str(tmp / "api.sock")
        self.gate = Gate(self.sock, MAX_BODY, api_keys)
        self.loop = asyncio.new_event_loop()
        self.port = 0
        self.upstream_up = upstream_up
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self.loop.run_until_complete, args=(self._main(),), daemon=True)

    async def _main(self) -> None:
        self.stop = asyncio.Event()
        server = None
        if self.upstream_up:
            server = uvicorn.Server(uvicorn.Config(self.app, uds=self.sock, log_level="warning", http="httptools",
                                                   loop="asyncio", lifespan="off"))
            task = asyncio.create_task(server.serve())
            while not server.started:
                await asyncio.sleep(0.01)

        def ready(s: asyncio.AbstractServer) -> None:
            self.port = s.sockets[0].getsockname()[1]
            self._ready.set()

        await serve(self.gate, "127.0.0.1", 0, ready, self.stop)
        if server is not None:
            server.should_exit = True
            await task

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Running:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self._thread.join(10)


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    with Running(tmp_path, ApiKeys({KEY: "alice"})) as r:
        yield r


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def _raw(port: int, data: bytes, wait_s: float = 5.0) -> bytes:
    """Send ``data``, return everything until the gate closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_requests_pass_through_keep_alive_query_and_all(running: Running) -> None:
    with httpx.Client(base_url=running.base, timeout=10) as c:
        for i in range(3):  # one connection, three requests
            r = c.post(f"/echo?i={i}", content=b"x" * (MAX_BODY - i), headers=_auth())
            assert r.status_code == 200, r.text
            assert r.json() == {"path": "/echo", "query": f"i={i}", "bytes": MAX_BODY - i, "body": "x" * 64,
                                "auth": f"Bearer {KEY}", "chunked": ""}
        assert c.get("/health").status_code == 200  # open without a key, as the engine's /health
    assert running.app.seen == [("POST", "/echo")] * 3 + [("GET", "/health")]


def test_a_body_past_the_bound_is_refused_413_without_the_engine(running: Running) -> None:
    r = httpx.post(running.base + "/echo", content=b"x" * (MAX_BODY + 1), headers=_auth())
    assert r.status_code == 413
    assert r.json()["error"]["message"].startswith(f"Content Too Large: at most {MAX_BODY} bytes")
    assert r.headers["connection"] == "close"
    # declared, never sent: answered from the head alone
    out = _raw(running.port, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 999999999\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 413 ")
    assert running.app.seen == []


def test_a_chunked_body_is_forwarded_and_refused_once_past_the_bound(running: Running) -> None:
    def parts(n: int) -> Iterator[bytes]:
        for _ in range(n):
            yield b"y" * 1000

    r = httpx.post(running.base + "/echo", content=parts(3), headers=_auth())
    assert r.status_code == 200 and r.json()["bytes"] == 3000 and r.json()["chunked"] == "chunked"
    r = httpx.post(running.base + "/echo", content=parts(10), headers=_auth())
    assert r.status_code == 413 and "(chunked)" in r.json()["error"]["message"]


def test_a_request_without_a_valid_key_is_refused_401_without_the_engine(running: Running) -> None:
    for headers in ({}, {"Authorization": "Bearer " + "z" * 24}, {"Authorization": KEY}):
        r = httpx.post(running.base + "/echo", content=b"{}", headers=headers)
        assert r.status_code == 401, headers
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(running.base + "/metrics?x=1").status_code == 200  # open paths, with a query too
    assert running.app.seen == [("GET", "/metrics")]


def test_no_keys_no_key_check(tmp_path: Path) -> None:
    with Running(tmp_path, None) as r:
        assert httpx.post(r.base + "/echo", content=b"{}").status_code == 200


def test_a_stream_arrives_as_it_is_sent_and_a_client_that_leaves_is_seen_by_the_engine(running: Running) -> None:
    with httpx.Client(base_url=running.base, timeout=10) as c:
        with c.stream("POST", "/stream", json={"n": 3}, headers=_auth()) as r:
            assert [line for line in r.iter_lines() if line] == ["data: 0", "data: 1", "data: 2", "data: [DONE]"]
        with c.stream("POST", "/stream", json={"n": 100}, headers=_auth()) as r:
            it = r.iter_lines()
            assert next(it) == "data: 0"
    # leaving the with block closed the connection: the app's request sees its client go
    assert running.app.disconnected.wait(5)


def test_an_engine_not_answering_is_a_503_with_retry_after(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gate_mod, "CONNECT_TRIES_S", 0.2)
    with Running(tmp_path, None, upstream_up=False) as r:
        resp = httpx.post(r.base + "/echo", content=b"{}")
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"


def test_slow_and_oversized_heads_are_cut_off(running: Running, monkeypatch: pytest.MonkeyPatch) -> None:
    out = _raw(running.port, b"GET /health HTTP/1.1\r\nX-Pad: " + b"p" * (gate_mod.HEAD_BYTES + 10) + b"\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 431 ")
    assert _raw(running.port, b"NOT HTTP AT ALL\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert _raw(running.port, b"GET /health HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n").startswith(
        b"HTTP/1.1 400 ")
    monkeypatch.setattr(gate_mod, "HEAD_TIMEOUT_S", 0.3)
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", running.port), timeout=5) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        assert s.recv(100) == b""  # closed by the gate
    assert time.monotonic() - t0 < 4
    assert running.app.seen == []


def test_the_process_reports_a_taken_port_and_is_started_again_if_it_dies(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        g = GateProcess("127.0.0.1", taken.getsockname()[1], MAX_BODY)
        with pytest.raises(ConfigError, match="gate did not start"):
            g.start()
        g.stop()
    g = GateProcess("127.0.0.1", 0, MAX_BODY)
    g.RESPAWN_WAIT_S = 0.1
    g.start()
    try:
        assert g.proc is not None
        first = g.proc.pid
        # no engine behind it: the gate itself answers
        assert httpx.post(f"http://127.0.0.1:{g.port}/x", content=b"z" * (MAX_BODY + 1)).status_code == 413
        g.proc.kill()
        deadline = time.monotonic() + 20
        while (g.proc.pid == first or g.proc.poll() is not None) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert g.proc.pid != first
        assert httpx.post(f"http://127.0.0.1:{g.port}/x", content=b"z" * (MAX_BODY + 1)).status_code == 413
    finally:
        g.stop()
    assert g.proc.poll() is not None and not Path(g.socket).parent.exists()


def test_the_gate_goes_when_its_engine_is_killed(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    code = ("import time; from engine.gate import GateProcess; g = GateProcess('127.0.0.1', 0, 4096); g.start(); "
            "print(g.proc.pid, flush=True); time.sleep(120)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert parent.stdout is not None
        pid = int(parent.stdout.readline())
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text() \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    finally:
        parent.kill()


def test_auto_puts_the_gate_in_front_only_with_cores_to_spare() -> None:
    assert not gate_mod.wanted("auto", 2, 1)  # this machine with the soak's one thread: the gate lost
    assert not gate_mod.wanted("auto", 8, 8)  # torch's default threads take every core
    assert gate_mod.wanted("auto", 3, 1) and gate_mod.wanted("auto", 64, 1)  # a GPU host's step thread
    assert gate_mod.wanted("on", 1, 1) and not gate_mod.wanted("off", 64, 1)
    with pytest.raises(ValueError, match="--gate must be one of"):
        gate_mod.wanted("yes", 4, 1)


def test_a_containers_cpu_quota_counts_not_just_the_affinity(tmp_path: Path) -> None:
    import os

    f = tmp_path / "cpu.max"
    f.write_text("50000 100000\n")  # half a CPU: 1, whatever the affinity says
    assert gate_mod.available_cpus(str(f)) == 1
    f.write_text("150000 100000\n")  # a 1.5-CPU limit: 2 CPUs, rounded up
    assert gate_mod.available_cpus(str(f)) == min(2, len(os.sched_getaffinity(0)))
    f.write_text("max 100000\n")
    assert gate_mod.available_cpus(str(f)) == len(os.sched_getaffinity(0))
    assert gate_mod.available_cpus(str(tmp_path / "none")) == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("gate", ["off", "on"])
def test_serve_on_a_taken_port_is_one_line_and_exit_2(tiny_model_dir: Path, gate: str) -> None:
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "engine.cli", "serve", "--model", str(tiny_model_dir), "--port",
                            str(port), "--gate", gate, "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert f"127.0.0.1:{port}" in last and ("Address already in use" in last or "gate did not start" in last), last
