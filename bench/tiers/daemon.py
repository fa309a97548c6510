"""Daemon end to end vs Redis, for ``bench.tiers`` (key ``daemon`` of its JSON).

A ``kvstore serve`` subprocess (default cpu tier) and the Redis at ``redis_url`` are loaded
with the same 0.5-2 MB encoded blocks; then a *separate client process* — the situation of an
engine replica beside the daemon — reads all blocks through ``KVStoreClient`` and through
redis-py, rounds interleaved so both see the same machine state, and reports the median
throughput of each (bench.tiers.figures). The Redis side is redis-py with hiredis and RedisTier's
1 MiB socket reads (bench.tiers.baselines), the best of a GET loop, a pipelined GET batch and one
MGET (``redis_get_gbps``, ``redis_baseline`` names the winner), all returning fresh bytes.

- ``vs_redis`` (the headline; issue 9): ``get_copy_gbps / redis_get_gbps``, bytes the caller owns
  on both sides. Until issue 9 it was ``get_gbps`` (views) over a weaker Redis baseline; that
  comparison of untouched views with built bytes is kept only as ``vs_redis_views``.
- ``get_gbps``: ``get_many`` as an application calls it. On the same host each block comes
  back as a read-only *view* of the shared-memory segment the daemon wrote (no client copy).
- ``get_copy_gbps``: ``get_many(copy=True)``, fresh bytes objects like redis-py returns.
- ``get_into_gbps``: ``read_many`` copying each block once into a pre-faulted buffer, as the
  connector does into its KV pool (``vs_redis_into`` beside the headline).
- ``tcp_get_gbps`` (issue 11): a client with ``use_shm=False`` — the daemon's raw TCP Get channel
  over loopback (gRPC streaming where a daemon has none), as a replica without shared memory
  gets — reading multi-MB blocks with ``get_many`` (buffers the caller owns, each received
  straight into its own); ``tcp_into_gbps``: the same into a pre-faulted buffer with ``read_many``.
- ``concurrent_scaling``: aggregate ``get_many(copy=True)`` GB/s (bytes the callers own) of 4
  client *processes* (one GIL each) on the one daemon, divided by that of 1 client. Each client
  reads every block ``rounds`` times once all are ready; aggregate = all bytes / (last end - first
  start). 1- and 4-client runs alternate, 3 of each, medians compared; the load average is
  recorded, since the machine may be shared.

    python -m bench.tiers.daemon --redis redis://127.0.0.1:6379/0 [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.servers import spawn_daemon, stop_daemon
from bench.tiers import figures as fig

LOOPBACK = "127.0.0.1"


def _blocks(n: int, seed: int = 0, min_bytes: int = 512 * 1024, max_bytes: int = 2 * 1024 * 1024,
            tag: int = 0) -> list[tuple[bytes, bytes]]:
    from kvstore.block import encode_block

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        key = (tag << 32 | i).to_bytes(8, "little") + rng.bytes(8)
        nbytes = int(rng.integers(min_bytes, max_bytes + 1)) // 4 * 4
        arr = rng.integers(0, 2**31, size=nbytes // 4, dtype=np.int32).view(np.float32)
        out.append((key, encode_block(key, arr, layout="bench")))
    return out


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


Batch = list[tuple[int, memoryview]]  # what one round of KVStoreClient.read_batches hands its consumer


def _pool_sink(sizes: list[int]) -> Callable[[Batch], None]:
    """A consumer copying block i into its place in one pre-faulted buffer, as a connector's KV pool."""
    pool = np.ones(sum(sizes), dtype=np.uint8)
    offsets = np.concatenate([[0], np.cumsum(sizes)])

    def into_pool(items: Batch) -> None:
        for i, mv in items:
            pool[offsets[i] : offsets[i + 1]] = np.frombuffer(mv, dtype=np.uint8)

    return into_pool


def _copied(c: Any, keys: list[bytes]) -> list[bytes | None]:
    """Each block as bytes of its own (None for a miss): the client's read, every view copied out."""
    out: list[bytes | None] = [None] * len(keys)

    def copy_out(items: Batch) -> None:
        for i, mv in items:
            out[i] = bytes(mv)

    c.read_batches(keys, copy_out)
    return out


def _maps_shm() -> bool:
    """Whether this process maps a client segment (/proc/self/maps): a client in it reads over shared memory."""
    from kvstore.client.shm import SEGMENT_PREFIX

    return f"/memfd:{SEGMENT_PREFIX}" in Path("/proc/self/maps").read_text()


def _client_main(address: str, redis_url: str, keys_file: str, rounds: int) -> None:
    """Runs in the separate client process: prints one JSON line of timings."""
    from bench.tiers.baselines import redis_client_like
    from kvstore.client.client import KVStoreClient

    spec = json.loads(Path(keys_file).read_text())
    keys = [bytes.fromhex(k) for k in spec["keys"]]
    tcp_keys = [bytes.fromhex(k) for k in spec["tcp_keys"]]
    rkeys = [b"bench:" + k for k in keys]
    r = redis_client_like(redis_url)
    t: dict[str, list[float]] = {n: [] for n in ("views", "copy", "into", "redis_loop", "redis_pipe", "redis_mget",
                                                 "tcp_get", "tcp_into")}
    with KVStoreClient(address, deadline_s=30.0) as c, KVStoreClient(address, deadline_s=60.0, use_shm=False) as tcp:
        got = _copied(tcp, tcp_keys)  # warm-up + correctness, the streamed client first:
        assert [len(g) if g else 0 for g in got] == spec["tcp_sizes"], "daemon (tcp) returned wrong blocks"
        tcp_shm = _maps_shm()  # ... so that a segment mapped now is its own
        got = _copied(c, keys)
        assert [len(g) if g else 0 for g in got] == spec["sizes"], "daemon returned wrong blocks"
        assert [len(v or b"") for v in r.mget(rkeys)] == spec["sizes"], "redis returned wrong blocks"
        shm = _maps_shm()
        del got
        into, tcp_into = _pool_sink(spec["sizes"]), _pool_sink(spec["tcp_sizes"])

        def pipelined() -> list[bytes]:
            p = r.pipeline(transaction=False)
            for k in rkeys:
                p.get(k)
            return p.execute()

        passes: dict[str, Callable[[], object]] = {
            "copy": lambda: _copied(c, keys),
            "into": lambda: c.read_batches(keys, into),
            "views": lambda: c.read_batches(keys, lambda items: None),  # views, valid during the call
            "redis_loop": lambda: [r.get(k) for k in rkeys],
            "redis_pipe": pipelined,
            "redis_mget": lambda: r.mget(rkeys),
            "tcp_get": lambda: _copied(tcp, tcp_keys),
            "tcp_into": lambda: tcp.read_batches(tcp_keys, tcp_into),
        }
        for i in range(rounds):
            names = list(passes) if i % 2 == 0 else list(reversed(passes))  # no side always runs first
            for name in names:
                t[name].append(_timed(passes[name]))
    r.close()
    print(json.dumps({"bytes": sum(spec["sizes"]), "tcp_bytes": sum(spec["tcp_sizes"]), "s": t, "shm": shm,
                      "tcp_shm": tcp_shm}))


def _scaling_client_main(address: str, keys_file: str, rounds: int) -> None:
    """One of the concurrent clients: warm up, say ready, wait for go, time ``rounds`` passes."""
    from kvstore.client.client import KVStoreClient

    keys = [bytes.fromhex(k) for k in json.loads(Path(keys_file).read_text())["keys"]]
    with KVStoreClient(address, deadline_s=60.0) as c:
        nbytes = sum(len(b) for b in _copied(c, keys) if b is not None)
        print("ready", flush=True)
        sys.stdin.readline()
        start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on the host
        for _ in range(rounds):
            got = _copied(c, keys)
            del got
        end = time.monotonic()
    print(json.dumps({"bytes": nbytes * rounds, "start": start, "end": end}), flush=True)


def _aggregate_gbps(clients: int, address: str, keys_file: Path, rounds: int) -> float:
    """Aggregate copying-get GB/s of ``clients`` processes reading at once."""
    argv = [sys.executable, "-m", "bench.tiers.daemon", "--scaling-client", "--address", address,
            "--keys-file", str(keys_file), "--rounds", str(rounds)]  # fmt: skip
    procs = [subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(clients)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready", "scaling client did not start"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        res = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return sum(r["bytes"] for r in res) / (max(r["end"] for r in res) - min(r["start"] for r in res)) / 1e9


def measure_scaling(address: str, keys_file: Path, rounds: int, clients: int = 4, reps: int = 3) -> dict[str, float]:
    one: list[float] = []
    many: list[float] = []
    load = os.getloadavg()[0]
    for _ in range(reps):
        one.append(_aggregate_gbps(1, address, keys_file, rounds))
        many.append(_aggregate_gbps(clients, address, keys_file, rounds))
    return {
        "concurrent_scaling": round(fig.scaling_ratio(one, many), 2),
        "concurrent_clients": clients,
        "concurrent_get_gbps_1": round(statistics.median(one), 3),
        f"concurrent_get_gbps_{clients}": round(statistics.median(many), 3),
        "concurrent_loadavg_1m": round((load + os.getloadavg()[0]) / 2, 2),
    }


def figures(res: dict[str, Any]) -> dict[str, Any]:
    """The daemon's figures from the client process's timings (see the module docstring)."""
    s, n = res["s"], res["bytes"]
    best, best_s = fig.best_baseline({"get_loop": s["redis_loop"], "pipelined_get": s["redis_pipe"],
                                      "mget": s["redis_mget"]})
    return {
        "get_gbps": round(fig.gbps(n, s["views"]), 3),
        "get_copy_gbps": round(fig.gbps(n, s["copy"]), 3),
        "get_into_gbps": round(fig.gbps(n, s["into"]), 3),
        "redis_get_gbps": round(fig.gbps(n, best_s), 3),
        "redis_baseline": f"redis-py {best} (hiredis, 1 MiB socket reads), fresh bytes",
        "redis_get_loop_gbps": round(fig.gbps(n, s["redis_loop"]), 3),
        "redis_pipeline_gbps": round(fig.gbps(n, s["redis_pipe"]), 3),
        "redis_mget_gbps": round(fig.gbps(n, s["redis_mget"]), 3),
        "vs_redis": round(fig.ratio_of_medians(s["copy"], best_s), 2),
        "vs_redis_path": "get_many(copy=True): bytes the caller owns, like redis-py's",
        "vs_redis_paired": round(fig.paired_ratio(s["copy"], best_s), 2),
        "vs_redis_into": round(fig.ratio_of_medians(s["into"], best_s), 2),
        "vs_redis_views": round(fig.ratio_of_medians(s["views"], best_s), 2),
        "tcp_get_gbps": round(fig.gbps(res["tcp_bytes"], s["tcp_get"]), 3),
        "tcp_into_gbps": round(fig.gbps(res["tcp_bytes"], s["tcp_into"]), 3),
        "tcp_path": "use_shm=False: raw TCP Get channel over loopback, get_many -> buffers the caller owns",
        "tcp_shm": bool(res["tcp_shm"]),
    }


@dataclass(frozen=True)
class Plan:
    blocks: int  # 0.5-2 MB blocks read by the shm client and Redis
    rounds: int
    tcp_blocks: int  # 4 MiB blocks read by the streamed (use_shm=False) client
    scaling_reps: int = 3
    scaling_clients: int = 4


QUICK, FULL = Plan(blocks=32, rounds=5, tcp_blocks=12), Plan(blocks=96, rounds=9, tcp_blocks=32)


def measure_daemon(quick: bool, redis_url: str, plan: Plan | None = None) -> dict[str, Any]:
    """Start a daemon, load it and Redis with the same blocks, time gets from another process."""
    from bench.tiers.baselines import redis_client_like
    from kvstore.client.client import KVStoreClient

    plan = plan or (QUICK if quick else FULL)
    n, rounds, n_tcp = plan.blocks, plan.rounds, plan.tcp_blocks
    blocks = _blocks(n)
    tcp_blocks = _blocks(n_tcp, seed=1, min_bytes=4 << 20, max_bytes=4 << 20, tag=1)  # 4 MiB: multi-MB
    total = sum(len(b) for _, b in blocks) + sum(len(b) for _, b in tcp_blocks)
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-daemon-") as tmp:
        proc, address = spawn_daemon(Path(tmp), "--cpu", str(max(total * 2, 64 << 20)))
        r = redis_client_like(redis_url)
        try:
            with KVStoreClient(address, deadline_s=60.0) as c:
                c.put_many(blocks)
                c.put_many(tcp_blocks)
            r.mset({b"bench:" + k: b for k, b in blocks})
            keys_file = Path(tmp) / "keys.json"
            keys_file.write_text(json.dumps({"keys": [k.hex() for k, _ in blocks], "sizes": [len(b) for _, b in blocks],
                                             "tcp_keys": [k.hex() for k, _ in tcp_blocks],
                                             "tcp_sizes": [len(b) for _, b in tcp_blocks]}))
            out = subprocess.run(
                [sys.executable, "-m", "bench.tiers.daemon", "--client", "--address", address, "--redis", redis_url,
                 "--keys-file", str(keys_file), "--rounds", str(rounds)],
                capture_output=True, text=True, timeout=600, check=True,
            )  # fmt: skip
            scaling = measure_scaling(address, keys_file, rounds=rounds * 2, clients=plan.scaling_clients,
                                      reps=plan.scaling_reps)
        finally:
            r.delete(*[b"bench:" + k for k, _ in blocks])
            r.close()
            stop_daemon(proc)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return {
        **figures(res),
        "blocks": n,
        "bytes": res["bytes"],
        "tcp_blocks": n_tcp,
        "tcp_block_bytes": len(tcp_blocks[0][1]),
        "rounds": rounds,
        "shm": bool(res["shm"]),
        **scaling,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.tiers.daemon", description=__doc__.splitlines()[0])
    ap.add_argument("--redis", help="redis:// URL (default: start a private redis-server)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--scaling-client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--keys-file", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        _client_main(args.address, args.redis, args.keys_file, args.rounds)
        return
    if args.scaling_client:
        _scaling_client_main(args.address, args.keys_file, args.rounds)
        return
    if args.redis:
        print(json.dumps(measure_daemon(args.quick, args.redis), indent=2))
        return
    from bench.servers import redis_server

    with redis_server() as url:
        print(json.dumps(measure_daemon(args.quick, url), indent=2))


if __name__ == "__main__":
    main()
