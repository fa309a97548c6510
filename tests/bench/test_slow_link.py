"""bench/slow_link.py: bytes cross unchanged both ways, the rate and the delay hold them back, and
closing the proxy ends its connections. Timing checks are lower bounds only (a busy machine can
only make a transfer slower), with the rate set so the bound is seconds, not milliseconds."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from bench.slow_link import SlowLink


@pytest.fixture()
def echo():
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except TimeoutError:
                continue
            threading.Thread(target=_echo, args=(c,), daemon=True).start()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()
    stop.set()
    t.join()
    srv.close()


def _echo(c: socket.socket) -> None:
    with c:
        while data := c.recv(65536):
            c.sendall(data)


def _roundtrip(address: str, payload: bytes) -> tuple[bytes, float]:
    host, port = address.rsplit(":", 1)
    t0 = time.monotonic()
    with socket.create_connection((host, int(port))) as s:
        got = bytearray()
        sender = threading.Thread(target=s.sendall, args=(payload,))
        sender.start()
        while len(got) < len(payload):
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        sender.join()
    return bytes(got), time.monotonic() - t0


def test_bytes_cross_unchanged_and_the_rate_holds_them_back(echo) -> None:
    payload = bytes(range(256)) * 4096  # 1 MiB
    with SlowLink(echo) as fast:
        got, _ = _roundtrip(fast.address, payload)
        assert got == payload and fast.bytes_forwarded == 2 * len(payload)
    with SlowLink(echo, rate_bytes_per_s=512 * 1024, burst_bytes=64 * 1024) as slow:
        got, dt = _roundtrip(slow.address, payload)
    # 1 MiB at 512 KiB/s each way (the directions overlap): at least ~2 s less the burst
    assert got == payload and dt >= 1.8


def test_the_delay_is_added_each_way_and_the_rate_can_change(echo) -> None:
    with SlowLink(echo, delay_s=0.25) as link:
        got, dt = _roundtrip(link.address, b"ping")
        assert got == b"ping" and dt >= 0.5  # one way out, one way back
        link.set_delay(0.0)
        link.set_rate(256 * 1024)
        got, dt = _roundtrip(link.address, b"x" * (512 * 1024))
        assert len(got) == 512 * 1024 and dt >= 1.0


def test_close_ends_open_connections_and_bad_settings_are_refused(echo) -> None:
    link = SlowLink(echo).start()
    host, port = link.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    s.sendall(b"hi")
    assert s.recv(16) == b"hi"
    link.close()
    s.settimeout(5)
    assert s.recv(16) == b""  # the proxy closed its side
    s.close()
    with pytest.raises(ValueError):
        SlowLink(echo, rate_bytes_per_s=-1)
