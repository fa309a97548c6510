"""The metrics port's timeouts: a client that connects and sends nothing does not hold a thread."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.fixtures_kvstore import served
from tests.kvstore.limits_support import WAIT_S, settings

pytestmark = pytest.mark.timeout(120)


def test_a_silent_metrics_connection_is_closed(tmp_path: Path) -> None:
    with served(tmp_path, "--no-auth", "--metrics-listen", "127.0.0.1:0", env=settings(metrics_timeout_s=0.5)) as d:
        with socket.create_connection(("127.0.0.1", d.metrics_port), timeout=WAIT_S) as s:
            assert s.recv(1) == b""  # closed by the daemon; without a timeout this read would wait
        with socket.create_connection(("127.0.0.1", d.metrics_port), timeout=WAIT_S) as s:
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            body = b"".join(iter(lambda: s.recv(65536), b""))
        assert b"200 OK" in body.split(b"\r\n")[0] and b"tierkv_spill_queue_timeouts_total 0.0" in body
