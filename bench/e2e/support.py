"""What every bench.e2e section shares: daemons, engines on one loaded model, one timed request,
the memcpy bandwidth of this machine and the facts about it a figure needs beside it."""

from __future__ import annotations

import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from bench.servers import running_daemon, spawn_daemon, stop_daemon
from connector.wiring import attach_tierkv, connector_of, detach_tierkv
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.request import Request, Status
from engine.sampling import SamplingParams

TIERS = ("cpu", "disk", "s3")


@contextmanager
def kv_daemon(work: Path, *flags: str, env: dict[str, str] | None = None):
    work.mkdir(parents=True, exist_ok=True)
    with running_daemon(work, *flags, env=env, log_path=work / "daemon.log") as address:
        yield address


@contextmanager
def kv_daemon_pid(work: Path, *flags: str, env: dict[str, str] | None = None):
    """``kv_daemon`` yielding (address, pid): the disk daemon's mappings are paged out by pid."""
    work.mkdir(parents=True, exist_ok=True)
    proc, address = spawn_daemon(work, *flags, env=env, log_path=work / "daemon.log")
    try:
        yield address, proc.pid
    finally:
        stop_daemon(proc)


class Bench:
    """One loaded model, engines on separate KV pools, one prefill model for every connector, one
    start-up probe per daemon (a running engine probes once; each fresh connector of the bench is
    seeded with that daemon's figure), and ``before_point(address)`` called before every timed
    point (bench.e2e.cold: the disk daemon's files evicted)."""

    def __init__(self, loaded, threads: int, prefill=None) -> None:
        self.loaded, self.threads, self.prefill = loaded, threads, prefill
        self.rng = np.random.default_rng(1234)
        self.probes: dict[str, object] = {}  # address -> connector.probe.ProbeResult (None: it could not time)
        self.cooler = None  # bench.e2e.cold.DiskCooler

    @property
    def threads_used(self) -> int:
        """torch threads the engines compute on (``threads`` 0: torch's default, as kvengine leaves it)."""
        return torch.get_num_threads()

    def before_point(self, address: str | None) -> None:
        if self.cooler is not None and address is not None:
            self.cooler.before(address)

    def engine(self, num_pages: int) -> LLMEngine:
        cfg = EngineConfig(num_pages=num_pages, num_threads=self.threads, max_prefill_tokens=8192)
        eng = LLMEngine(cfg, loaded=self.loaded)
        eng.pool.kv.fill_(0.0)  # fault the pool's memory in now, not inside the first timed request
        return eng

    def attach(self, eng: LLMEngine, address: str, **kw: object):
        known = address in self.probes
        conn = attach_tierkv(eng, address, prefill=self.prefill, **({"probe": False} if known else {}), **kw)
        self.prefill = conn.cost.prefill  # calibrate once per process
        if not known:
            self.probes[address] = conn.probe_result
        elif (res := self.probes[address]) is not None:
            conn.cost.seed(res.tier, res.latency_s, res.bandwidth)  # as the connector's own probe seeds it
        return conn

    def detach(self, eng: LLMEngine) -> None:
        """Detach the engine's connector, keeping its prefill model: the online correction it
        learned from the engine's steps belongs to the engine, as in a long-running server."""
        conn = connector_of(eng)
        if conn is not None:
            self.prefill = conn.cost.prefill
        detach_tierkv(eng)

    def text(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.integers(200, 40000, n)]


def run(eng: LLMEngine, ids: list[int], max_tokens: int, salt: str | None) -> tuple[float, float, Request]:
    """(TTFT = admission to first token, total seconds, the finished request)."""
    t0 = time.monotonic()
    rid = eng.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), cache_salt=salt)
    req = eng.requests[rid]
    while req.status is not Status.FINISHED:
        eng.step()
    return req.first_token_time - t0, time.monotonic() - t0, req  # type: ignore[operator]


def offload_prefix(b: Bench, eng: LLMEngine, addresses, ids: list[int], salt: str) -> int:
    """Save the full pages of ``ids`` that ``eng`` holds to every daemon, through the connector's
    own path; return the pages saved. The matched pages stay locked until every save is flushed:
    an unlocked page can be evicted (attaching a connector takes scratch pages) and reused, and
    its new bytes would then be stored under these keys."""
    full = len(ids) // eng.pool.page_size * eng.pool.page_size
    m = eng.radix.match_prefix(ids[:full], record_stats=False, salt=salt)
    if m.num_tokens != full:
        raise RuntimeError(f"the engine holds {m.num_tokens} of the {full} tokens to offload")
    eng.radix.lock(m.node)
    try:
        for address in addresses:
            conn = b.attach(eng, address, load_mode="always")
            try:
                conn.save(conn.keyspace.keys(ids[:full], salt), m.pages)
                if not conn.flush(300):
                    raise RuntimeError(f"offload to {address} did not finish")
            finally:
                detach_tierkv(eng)
    finally:
        eng.radix.unlock(m.node)
    return len(m.pages)


def loaded_by_tier(conn) -> dict[str, float]:
    return {t: conn.metrics.value("tierkv_connector_loaded_tokens_total", tier=t) for t in (*TIERS, "redis")}


class ThreadedCopy:
    """``np.copyto(dst, src)`` split into ``threads`` contiguous parts copied at once (numpy
    releases the GIL for the copy): a memcpy floor on as many threads as the load it is set
    against (a load of >= 4 MiB copies on ``native.default_threads()``)."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads) if self.threads > 1 else None

    def __call__(self, dst: np.ndarray, src: np.ndarray) -> None:
        if self._pool is None:
            np.copyto(dst, src)
            return
        bounds = np.linspace(0, src.size, self.threads + 1).astype(int)
        list(self._pool.map(lambda i: np.copyto(dst[bounds[i] : bounds[i + 1]], src[bounds[i] : bounds[i + 1]]),
                            range(self.threads)))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


def memcpy_bandwidth(threads: int = 1) -> float:
    """Bytes/s of the best of 3 copies of 256 MiB (numpy copyto on ``threads`` threads)."""
    a = np.ones(256 * 2**20 // 8)
    b = np.empty_like(a)
    copy = ThreadedCopy(threads)
    best = float("inf")
    try:
        for _ in range(3):
            t0 = time.perf_counter()
            copy(b, a)
            best = min(best, time.perf_counter() - t0)
    finally:
        copy.close()
    return a.nbytes / best


def git_revision() -> str:
    """HEAD of the checkout this code runs from, with ``-dirty`` when files differ from it."""
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":(top)",
                                ":(top,exclude)bench/results"], cwd=root,
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return rev + ("-dirty" if dirty else "")


def machine_facts() -> dict:
    """Cores, torch threads, git revision and the load average now (call again at the end)."""
    return {"cpu_count": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)),
            "torch_threads": torch.get_num_threads(), "torch_version": torch.__version__,
            "git_revision": git_revision(), "loadavg_start": list(os.getloadavg())}
