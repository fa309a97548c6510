"""Helpers for the dashboard tests (no tests here): headless Chromium driven over the DevTools protocol.

A minimal WebSocket client (RFC 6455: text frames out, masked; frames in, fragmented or not) is
all the protocol needs; the venv has no WebSocket package. Chromium is Debian's ``chromium``
(scripts/system-deps.sh installs it); it runs with its own profile in the test's tmp dir.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


class _WebSocket:
    def __init__(self, url: str, timeout_s: float) -> None:
        u = urlparse(url)
        self.sock = socket.create_connection((u.hostname, u.port), timeout=timeout_s)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
                          .encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            if not chunk:
                raise ConnectionError("DevTools closed the connection during the handshake")
            head += chunk
        if not head.startswith(b"HTTP/1.1 101"):
            raise ConnectionError(f"DevTools refused the WebSocket: {head[:80]!r}")
        self._buf = head.split(b"\r\n\r\n", 1)[1]

    def _read(self, n: int) -> bytes:
        while len(self._buf) < n:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise ConnectionError("DevTools closed the connection")
            self._buf += chunk
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def send(self, text: str) -> None:
        data, mask = text.encode(), os.urandom(4)
        n = len(data)
        head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n)
                                if n < 1 << 16 else bytes([0x80 | 127]) + struct.pack(">Q", n))
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def recv(self) -> str:
        parts = []
        while True:
            b0, b1 = self._read(2)
            n = b1 & 0x7F
            if n == 126:
                (n,) = struct.unpack(">H", self._read(2))
            elif n == 127:
                (n,) = struct.unpack(">Q", self._read(8))
            payload = self._read(n)
            if b0 & 0x0F == 0x8:
                raise ConnectionError("DevTools closed the WebSocket")
            if b0 & 0x0F in (0x9, 0xA):  # ping / pong: nothing to do for a short test
                continue
            parts.append(payload)
            if b0 & 0x80:
                return b"".join(parts).decode()

    def close(self) -> None:
        self.sock.close()


class Browser:
    """One headless Chromium with one page; collects console errors and uncaught exceptions."""

    def __init__(self, tmp: Path, timeout_s: float = 60.0) -> None:
        exe = chromium_path()
        if exe is None:
            raise RuntimeError("no chromium")
        self.timeout_s = timeout_s
        self.errors: list[str] = []
        self._id = 0
        self.proc = subprocess.Popen([exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                      "--disable-dev-shm-usage", "--window-size=1100,1000",
                                      "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
                                      f"--user-data-dir={tmp / 'chromium-profile'}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            port = self._devtools_port()
            self._drainer = threading.Thread(target=self._drain, daemon=True)  # a full pipe would stall chromium
            self._drainer.start()
            targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=timeout_s).json()
            page = next(t for t in targets if t.get("type") == "page")
            self.ws = _WebSocket(page["webSocketDebuggerUrl"], timeout_s)
            for domain in ("Runtime", "Log", "Page"):
                self.call(f"{domain}.enable")
        except BaseException:
            self.close()
            raise

    def _devtools_port(self) -> int:
        assert self.proc.stderr is not None
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode} before DevTools started")
            if m := re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line):
                return int(m.group(1))
        raise TimeoutError("chromium did not start DevTools in time")

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for _ in self.proc.stderr:
            pass

    def _event(self, msg: dict[str, Any]) -> None:
        m, p = msg.get("method"), msg.get("params", {})
        if m == "Runtime.exceptionThrown":
            self.errors.append(f"exception: {p['exceptionDetails'].get('text')} "
                               f"{p['exceptionDetails'].get('exception', {}).get('description', '')}")
        elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            self.errors.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
        elif m == "Log.entryAdded" and p["entry"]["level"] == "error":
            self.errors.append(f"log: {p['entry']['text']} ({p['entry'].get('url', '')})")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self._event(msg)

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def eval(self, expression: str) -> Any:
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"{expression}: {res['exceptionDetails'].get('text')}")
        return res["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float | None = None) -> Any:
        """Poll ``expression`` until it is truthy (one that throws, e.g. while the page is still
        loading, counts as not yet); returns its value."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            res = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
            value = None if "exceptionDetails" in res else res["result"].get("value")
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"page never satisfied {expression}")
            time.sleep(0.1)

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            ws.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        drainer = getattr(self, "_drainer", None)
        if drainer is not None:
            drainer.join(timeout=10)  # ends at the pipe's EOF, now that chromium exited
        if self.proc.stderr is not None and (drainer is None or not drainer.is_alive()):
            self.proc.stderr.close()
