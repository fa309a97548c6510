"""The DoS phase's instrument runs in its own process (bench/soak/measure.py) and stamps on the
soak's clock: against a replica and a daemon that refuse connections, every answer is an error,
every health check a failure, and all of them fall inside the window the soak saw on its clock."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

from bench.soak.dos import Measure
from bench.soak.load import Prompt


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return port


def test_the_normal_client_runs_apart_and_reports_on_the_soak_clock() -> None:
    origin = time.monotonic() - 100.0  # the soak started 100 s ago
    load = SimpleNamespace(replicas=[f"http://127.0.0.1:{_closed_port()}"], model="m", api_keys={"t": "k"},
                           clock=lambda: time.monotonic() - origin)
    cluster = SimpleNamespace(daemon=SimpleNamespace(address=f"127.0.0.1:{_closed_port()}"))
    prompts = [Prompt("p0", [{"role": "user", "content": "hi"}])]
    begin = load.clock()
    with Measure(cluster, load, prompts, "t", 4) as m:  # type: ignore[arg-type]
        time.sleep(3.0)
    end = load.clock()
    assert m.answers and all(a.error for a in m.answers)
    assert all(begin <= a.t0 <= a.t1 <= end for a in m.answers)
    assert m.health and all(begin <= h[0] <= h[1] <= end for h in m.health)
    assert all(h[2] >= 5.0 for h in m.health)  # a refused /health counts as the full timeout
