"""bench/slow_link.py as the cluster's delay proxy: every byte through unchanged both ways, a round
trip at least twice the one-way delay (a sanity floor: load only adds), EOF passed on, a dead target
closes the client, and the proxy can live in a node's namespace."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from bench.cluster.topology import Topology
from bench.servers import free_port
from bench.slow_link import SlowLink


def _echo_server(host: str = "127.0.0.1") -> tuple[socket.socket, threading.Thread]:
    srv = socket.create_server((host, 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(1 << 16):
                    conn.sendall(data)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    srv, _ = _echo_server()
    yield srv.getsockname()
    srv.close()


def test_round_trip_pays_twice_the_delay(echo: tuple[str, int]) -> None:
    with SlowLink(echo, delay_s=0.05) as proxy, socket.create_connection(proxy.sockaddr, timeout=10) as c:
        for _ in range(3):
            t0 = time.monotonic()
            c.sendall(b"ping")
            assert c.recv(4) == b"ping"
            assert time.monotonic() - t0 >= 0.095  # 2 x 50 ms one way, minus timer slack


def test_bytes_pass_unchanged_both_ways_and_eof_follows(echo: tuple[str, int]) -> None:
    payload = os.urandom(1 << 20)
    with SlowLink(echo, delay_s=0.01) as proxy, socket.create_connection(proxy.sockaddr, timeout=10) as c:
        def send() -> None:
            c.sendall(payload)
            c.shutdown(socket.SHUT_WR)  # EOF crosses the proxy; the echo server closes; so do we

        sender = threading.Thread(target=send)
        sender.start()
        got = bytearray()
        while data := c.recv(1 << 16):
            got += data
        sender.join()
    assert bytes(got) == payload


def test_a_dead_target_closes_the_client() -> None:
    with SlowLink(("127.0.0.1", free_port()), delay_s=0.01) as proxy, \
            socket.create_connection(proxy.sockaddr, timeout=10) as c:  # fmt: skip
        assert c.recv(16) == b""


def test_the_proxy_lives_in_a_namespace(make_topology: Callable[..., Topology]) -> None:
    topo = make_topology(nodes=1, services=("svc",))
    with topo.entered("svc"):
        srv, _ = _echo_server(topo.addr("svc"))
    with SlowLink(srv.getsockname(), delay_s=0.02, netns=topo.ns("node0")) as proxy:
        with topo.entered("node0"), socket.create_connection(proxy.sockaddr, timeout=10) as c:
            c.sendall(b"through the veth")
            assert c.recv(64) == b"through the veth"
        with pytest.raises(OSError):  # its loopback port is the node's, not ours
            socket.create_connection(proxy.sockaddr, timeout=1).close()
    srv.close()


def test_closing_with_a_connection_open_logs_no_error(echo: tuple[str, int], caplog: pytest.LogCaptureFixture) -> None:
    """A client still connected when the link closes (a pooled HTTP connection): its task ends
    quietly, not as a cancelled task asyncio's stream callback reports as an error (Python 3.11)."""
    with SlowLink(echo, delay_s=0.001) as proxy, socket.create_connection(proxy.sockaddr, timeout=10) as c:
        c.sendall(b"hi")
        assert c.recv(2) == b"hi"
        proxy.close()
    assert not [r for r in caplog.records if r.name == "asyncio"], [r.getMessage() for r in caplog.records]
