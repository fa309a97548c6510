"""A bench killed with SIGTERM stops the servers it started (bench/servers.py exit_on_sigterm): a
``kill`` of bench.serve left its daemon and engine running, as a signal's default action skips
every ``with`` block's exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = """
import os, sys, time
from bench.servers import exit_on_sigterm, running_daemon
if sys.argv[2] == "guarded":
    exit_on_sigterm()
with running_daemon(sys.argv[1], "--cpu", "64MiB"):
    print(os.getpid(), flush=True)  # the daemon is the only child
    time.sleep(120)
"""


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


@pytest.mark.parametrize("mode", ["guarded", "unguarded"])
def test_sigterm_stops_the_servers_a_bench_started(tmp_path: Path, mode: str) -> None:
    bench = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path), mode], stdout=subprocess.PIPE, text=True)
    daemon = None
    try:
        assert bench.stdout is not None and int(bench.stdout.readline()) == bench.pid
        [daemon] = _children(bench.pid)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == (128 + signal.SIGTERM if mode == "guarded" else -signal.SIGTERM)
        deadline = time.monotonic() + (30 if mode == "guarded" else 2)
        while _alive(daemon) and time.monotonic() < deadline:
            time.sleep(0.1)
        # guarded: the with block stopped the daemon; unguarded (the signal's default action): it is
        # left running, which is what the guard is for
        assert _alive(daemon) == (mode == "unguarded")
    finally:
        bench.kill()
        for pid in _children(bench.pid) + ([daemon] if daemon is not None else []):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
