"""Leaked shared-memory sessions reclaimed: a client holding a session is SIGKILLed, and the daemon
must unmap its segment (``shm_reclaim_s``: from the kill to the first reading of the daemon's
/proc/PID/maps without it; the target is 30 s).

The client is a process of its own with a tenant's daemon credential: it attaches a segment (the
kernel's unix-socket connection is the session), puts and reads a block of its tenant through it,
prints its segment's memfd name, and sleeps until killed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.soak.cluster import Cluster
from bench.soak.security_figures import reclaim_seconds
from kvstore.client.shm import SEGMENT_PREFIX

ROOT = Path(__file__).resolve().parents[2]
CLIENT = """
import os, sys, time
import numpy as np
from kvstore.block import encode_block
from kvstore.client.client import KVStoreClient
from kvstore.keys import TENANT_MAGIC, tenant_tag
c = KVStoreClient(sys.argv[1], use_shm=True, shm_bytes=1 << 20)
key = TENANT_MAGIC + tenant_tag(sys.argv[2]) + os.urandom(16)
block = encode_block(key, np.arange(4096, dtype=np.float32))
c.put(key, block)
assert c.get_blocks([key])[0] is not None
print(" ".join(seg.name for seg, _ in c._shm._free), flush=True)
time.sleep(600)
"""


def segments_mapped(pid: int) -> set[str]:
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    return set(re.findall(rf"/memfd:({SEGMENT_PREFIX}[0-9a-f]+)", text))


def shm_reclaim(cluster: Cluster, tenant: str = "tenant-b", wait_s: float = 60.0) -> dict[str, Any]:
    """SIGKILL a client holding a session; how long the daemon kept its segment mapped."""
    pid = cluster.daemon.pid
    if pid is None:
        return {"shm_reclaim_s": None, "error": "daemon down"}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TIERKV_TOKEN": cluster.creds.daemon[tenant]}
    env.pop("TIERKV_TOKEN_FILE", None)
    client = subprocess.Popen([sys.executable, "-c", CLIENT, cluster.daemon.address, tenant], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)  # fmt: skip
    try:
        assert client.stdout is not None
        names = set(client.stdout.readline().split())
        mapped = segments_mapped(pid) & names
    finally:
        killed_at = time.monotonic()
        os.kill(client.pid, signal.SIGKILL)
        client.wait(30)
    if not names or not mapped:
        err = client.stderr.read()[-500:] if client.stderr is not None else ""
        return {"shm_reclaim_s": None, "error": f"the client held no session the daemon mapped: {names} {err}"}
    readings = []
    while time.monotonic() < killed_at + wait_s:
        t = time.monotonic()
        still = bool(segments_mapped(pid) & names)
        readings.append((t, still))
        if not still:
            break
        time.sleep(0.1)
    return {"shm_reclaim_s": reclaim_seconds(killed_at, readings), "segments": len(names), "waited_s": wait_s}
