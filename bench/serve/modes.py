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
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.servers import engine_server, prepare_bucket, redis_server, running_daemon, seaweedfs_s3

MODES = ("no_cache", "radix", "daemon_cpu", "daemon_disk", "daemon_s3", "daemon_redis")
NO_WT = "_no_write_through"  # daemon_cpu_no_write_through: offload on evict only (write-through's cost, at 1x)
CONNECTOR_ENV = {"TIERKV_CONNECTOR_WRITE_THROUGH": "1"}  # the daemon modes' connector settings


@dataclass(frozen=True)
class EngineSpec:
    num_pages: int  # 0: the pool from kv_memory
    page_size: int = 16
    threads: int = 2
    max_num_seqs: int = 16
    model: str = ""  # "" = the bundled SmolLM2-135M
    max_prefill_tokens: int = 0  # 0: the engine's default
    kv_memory: str = ""  # the pool as a size (e.g. 2Gi) when num_pages is 0


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
    tier = mode.removeprefix("daemon_").removesuffix(NO_WT)
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


@contextlib.contextmanager
def mode_server(mode: str, spec: EngineSpec, work: Path, timeout_s: float = 600.0,
                verbose: bool = False) -> Iterator[Server]:
    """``kvengine serve`` for ``mode`` (with its daemon), ready to answer (``verbose``: debug logs)."""
    work.mkdir(parents=True, exist_ok=True)
    with mode_daemon(mode, work / "daemon") as address:
        pool = ["--num-pages", str(spec.num_pages)] if spec.num_pages > 0 else ["--kv-memory", spec.kv_memory]
        flags = ["--no-blend", *pool, "--page-size", str(spec.page_size),
                 "--threads", str(spec.threads), "--max-num-seqs", str(spec.max_num_seqs)]
        if spec.max_prefill_tokens > 0:
            flags += ["--max-prefill-tokens", str(spec.max_prefill_tokens)]
        if address is not None:
            flags += ["--kvstore", address]
        if spec.model:
            flags += ["--model", spec.model]
        if verbose:
            flags.append("-v")
        wt = CONNECTOR_ENV if address is not None and not mode.endswith(NO_WT) else {}
        env = {"OMP_NUM_THREADS": str(spec.threads), **wt}
        with engine_server(*flags, env=env, log_path=work / "engine.log", timeout_s=timeout_s, grace_s=60) as engine:
            model = httpx.get(f"{engine.base}/v1/models", timeout=5).json()["data"][0]["id"]
            yield Server(mode, engine.port, model, work / "engine.log")
