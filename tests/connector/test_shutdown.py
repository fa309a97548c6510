"""`kvengine serve` on SIGTERM: stops taking requests, sends the KV offloads still staged (within
--shutdown-grace-s), closes the connector and exits 0 (and, once serving, has frozen its start-up objects)."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from bench.servers import EngineServer
from tests.connector.support import prompt
from tests.fixtures_kvstore import connect, daemon


def test_sigterm_flushes_staged_offloads_and_exits_zero(tiny_model_dir: Path, tmp_path: Path) -> None:
    ids = prompt(300, seed=41)  # 18 full pages
    with daemon(tmp_path, "--cpu", "64MiB") as d:
        env = {"TIERKV_CONNECTOR_WRITE_THROUGH": "1", "TIERKV_CONNECTOR_LOAD_MODE": "always",
               "TIERKV_CONNECTOR_PROBE": "0"}
        log = tmp_path / "engine.log"
        server = EngineServer("--model", str(tiny_model_dir), "--kvstore", d.address, "--num-pages", "128",
                              "--threads", "1", "--shutdown-grace-s", "120", "--gate", "on", env=env, log_path=log)
        proc, base = server.proc, server.base
        assert d.proc is not None
        try:
            server.wait_ready(120)
            # start-up's objects are frozen, out of the full collections' walk (engine/cli.py settle_heap)
            frozen = re.search(r"froze (\d+) start-up objects", log.read_text())
            assert frozen is not None and int(frozen.group(1)) > 10_000, log.read_text()[-2000:]
            # HTTP in C where it can be: it holds the step loop's interpreter less (engine/cli.py http_stack)
            assert "(uvloop, httptools)" in log.read_text(), log.read_text()[-2000:]
            # the gate in front (engine/gate.py): refusals answered in a process of its own
            gate_pid = re.search(r"gate \(pid (\d+)\)", log.read_text())
            assert gate_pid is not None, log.read_text()[-2000:]
            assert httpx.post(base + "/v1/completions", content=b"x" * (2 << 20), timeout=10).status_code == 413
            d.proc.send_signal(signal.SIGSTOP)  # the daemon stalls: the write-through offload stays staged
            body = {"prompt": ids, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            r = httpx.post(base + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 60
            while "flushing offloads" not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert "flushing offloads" in log.read_text()
            with pytest.raises(httpx.ConnectError):  # no longer taking requests
                httpx.post(base + "/v1/completions", json=body, timeout=5)
            assert proc.poll() is None  # still waiting for the stalled daemon
            d.proc.send_signal(signal.SIGCONT)
            assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
            assert not Path(f"/proc/{gate_pid.group(1)}").exists()  # the gate went with it
            with connect(d) as c:
                assert c.stats().tiers[0].blocks == 18  # every staged page reached the daemon
        finally:
            if d.proc is not None:
                d.proc.send_signal(signal.SIGCONT)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
