"""What each bench.serve mode runs: a real ``kvengine serve`` process, and for the daemon modes a
real ``kvstore serve`` daemon whose only tier is the one the mode names, with real redis-server
and SeaweedFS behind the redis and s3 tiers (all started by bench/servers.py). Everything
listens on free loopback ports and is stopped when the mode's ``with`` block ends.

``no_cache`` is the same server as ``radix``, with a fresh ``cache_salt`` on every request: no
request can reuse another's KV (a tenant of its own), through the API alone.

The daemon modes' connector writes through (``TIERKV_CONNECTOR_WRITE_THROUGH=1``, as LMCache does;
offload on evict stays on, and skips what was written): a request's pages go to the daemon when it
finishes, in the gap before the next arrival, instead of when a later request's admission evicts
them, where the copy and the send compete with that request's prefill on a 2-core machine. On the
RAG workload that moved daemon_s3's TTFT p90 from 0.94/0.81 s to 0.57/0.56 s (radix: 0.73/0.59 s).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.servers import LOOPBACK, free_port, prepare_bucket, redis_server, running_daemon, seaweedfs_s3

MODES = ("no_cache", "radix", "daemon_cpu", "daemon_disk", "daemon_s3", "daemon_redis")
CONNECTOR_ENV = {"TIERKV_CONNECTOR_WRITE_THROUGH": "1"}  # the daemon modes' connector settings
QUICK_MODES = ("radix", "daemon_cpu", "daemon_disk", "daemon_s3")


@dataclass(frozen=True)
class EngineSpec:
    num_pages: int
    page_size: int = 16
    threads: int = 2
    max_num_seqs: int = 16
    model: str = ""  # "" = the bundled SmolLM2-135M


@dataclass(frozen=True)
class Server:
    mode: str
    port: int
    model: str
    log: Path

    @property
    def salted(self) -> bool:
        """Every request gets its own cache_salt (the no-cache mode)."""
        return self.mode == "no_cache"


@contextlib.contextmanager
def mode_daemon(mode: str, work: Path) -> Iterator[str | None]:
    """The daemon of a mode (None: the mode has none), its tier's backing server included."""
    if not mode.startswith("daemon_"):
        yield None
        return
    tier = mode.removeprefix("daemon_")
    flags: list[str] = []
    env: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        if tier == "cpu":
            flags = ["--cpu", "4GiB"]
        elif tier == "disk":
            flags = ["--disk", f"{work / 'lmdb'}:8GiB"]
        elif tier == "redis":
            flags = ["--redis", stack.enter_context(redis_server())]
        elif tier == "s3":
            ep = stack.enter_context(seaweedfs_s3())
            bucket = f"tierkv-serve-{uuid.uuid4().hex[:8]}"
            prepare_bucket(ep, bucket)
            flags = ["--s3", f"s3://{bucket}/kv", "--s3-endpoint", ep.url]
            env = {"AWS_ACCESS_KEY_ID": ep.access_key, "AWS_SECRET_ACCESS_KEY": ep.secret_key,
                   "AWS_DEFAULT_REGION": ep.region}
        else:
            raise ValueError(f"unknown mode {mode!r}")
        work.mkdir(parents=True, exist_ok=True)
        yield stack.enter_context(running_daemon(work, *flags, env=env, log_path=work / "daemon.log"))


def _wait_ready(proc: subprocess.Popen, port: int, log: Path, timeout_s: float) -> str:
    """The served model's name once /health answers; RuntimeError with the log's tail if it dies."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(f"http://{LOOPBACK}:{port}/health", timeout=2).status_code == 200:
                return httpx.get(f"http://{LOOPBACK}:{port}/v1/models", timeout=5).json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"kvengine serve did not come up (exit {proc.poll()}):\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def mode_server(mode: str, spec: EngineSpec, work: Path, timeout_s: float = 600.0,
                verbose: bool = False) -> Iterator[Server]:
    """``kvengine serve`` for ``mode`` (with its daemon), ready to answer (``verbose``: debug logs)."""
    work.mkdir(parents=True, exist_ok=True)
    with mode_daemon(mode, work / "daemon") as address:
        port = free_port()
        log = work / "engine.log"
        argv = [sys.executable, "-m", "engine.cli", "serve", "--listen", f"{LOOPBACK}:{port}", "--no-blend",
                "--num-pages", str(spec.num_pages), "--page-size", str(spec.page_size),
                "--threads", str(spec.threads), "--max-num-seqs", str(spec.max_num_seqs)]
        if address is not None:
            argv += ["--kvstore", address]
        if spec.model:
            argv += ["--model", spec.model]
        if verbose:
            argv.append("-v")
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(spec.threads))
        if address is not None:
            env.update(CONNECTOR_ENV)
        with open(log, "w") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
        try:
            model = _wait_ready(proc, port, log, timeout_s)
            yield Server(mode, port, model, log)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
