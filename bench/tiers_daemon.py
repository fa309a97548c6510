"""Daemon end to end vs Redis, for ``bench.tiers`` (key ``daemon`` of its JSON).

A ``kvstore serve`` subprocess (default cpu tier) and the Redis at ``redis_url`` are loaded
with the same 0.5-2 MB encoded blocks; then a *separate client process* — the situation of an
engine replica beside the daemon — reads all blocks through ``KVStoreClient.get_many`` and
through redis-py, rounds interleaved so both see the same machine state, and reports the
median throughput of each. The Redis figure is the better of a GET loop and a pipelined GET
batch, so ``vs_redis`` is not flattered by a weak baseline.

- ``get_gbps``: ``get_many`` as an application calls it. On the same host each block comes
  back as a read-only view of the shared-memory segment the daemon wrote (no client copy); the
  segment is reused once the views are dropped, as each round does.
- ``get_copy_gbps``: ``get_many(copy=True)``, fresh bytes objects like redis-py returns.
- ``get_into_gbps``: ``read_many`` copying each block once into a pre-faulted buffer, as the
  connector does into its KV pool.
- ``concurrent_scaling``: aggregate ``get_many(copy=True)`` GB/s (bytes the callers own) of 4
  client *processes* (one GIL each) on the one daemon, divided by that of 1 client. Each client
  reads every block ``rounds`` times once all are ready; aggregate = all bytes / (last end - first
  start). 1- and 4-client runs alternate, 3 of each, medians compared; the load average is
  recorded, since the machine may be shared.

    python -m bench.tiers_daemon --redis redis://127.0.0.1:6379/0 [--quick]
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
from pathlib import Path

import numpy as np

from kvstore.launch import spawn_daemon, stop_daemon

LOOPBACK = "127.0.0.1"


def _blocks(n: int, seed: int = 0) -> list[tuple[bytes, bytes]]:
    from kvstore.block import encode_block

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        key = i.to_bytes(8, "little") + rng.bytes(8)
        nbytes = int(rng.integers(512 * 1024, 2 * 1024 * 1024)) // 4 * 4
        arr = rng.integers(0, 2**31, size=nbytes // 4, dtype=np.int32).view(np.float32)
        out.append((key, encode_block(key, arr, layout="bench")))
    return out


def _client_main(address: str, redis_url: str, keys_file: str, rounds: int) -> None:
    """Runs in the separate client process: prints one JSON line of timings."""
    import redis

    from kvstore.client import KVStoreClient

    spec = json.loads(Path(keys_file).read_text())
    keys = [bytes.fromhex(k) for k in spec["keys"]]
    total = sum(spec["sizes"])
    r = redis.Redis.from_url(redis_url)
    with KVStoreClient(address, deadline_s=30.0) as c:
        got = c.get_many(keys)  # warm-up + correctness
        assert [len(g) if g else 0 for g in got] == spec["sizes"], "daemon returned wrong blocks"
        assert [len(r.get(b"bench:" + k) or b"") for k in keys] == spec["sizes"], "redis returned wrong blocks"
        # a pre-faulted destination, as a connector's KV pool would be
        pool = np.ones(total, dtype=np.uint8)
        offsets = np.concatenate([[0], np.cumsum(spec["sizes"])])

        def into_pool(i: int, mv: memoryview) -> None:
            pool[offsets[i] : offsets[i + 1]] = np.frombuffer(mv, dtype=np.uint8)

        d_t, copy_t, into_t, loop_t, pipe_t = [], [], [], [], []
        for _ in range(rounds):
            t = time.perf_counter()
            got = c.get_many(keys, copy=True)
            copy_t.append(time.perf_counter() - t)
            del got
            t = time.perf_counter()
            c.read_many(keys, into_pool)
            into_t.append(time.perf_counter() - t)
            t = time.perf_counter()
            got = c.get_many(keys)
            d_t.append(time.perf_counter() - t)
            del got
            t = time.perf_counter()
            vals = [r.get(b"bench:" + k) for k in keys]
            loop_t.append(time.perf_counter() - t)
            del vals
            t = time.perf_counter()
            p = r.pipeline(transaction=False)
            for k in keys:
                p.get(b"bench:" + k)
            vals = p.execute()
            pipe_t.append(time.perf_counter() - t)
            del vals
        shm = c.shm_active
    print(json.dumps({"bytes": total, "daemon_s": d_t, "copy_s": copy_t, "into_s": into_t, "redis_loop_s": loop_t, "redis_pipe_s": pipe_t, "shm": shm}))


def _scaling_client_main(address: str, keys_file: str, rounds: int) -> None:
    """One of the concurrent clients: warm up, say ready, wait for go, time ``rounds`` passes."""
    from kvstore.client import KVStoreClient

    keys = [bytes.fromhex(k) for k in json.loads(Path(keys_file).read_text())["keys"]]
    with KVStoreClient(address, deadline_s=60.0) as c:
        nbytes = sum(len(b) for b in c.get_many(keys, copy=True) if b is not None)
        print("ready", flush=True)
        sys.stdin.readline()
        start = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on the host
        for _ in range(rounds):
            got = c.get_many(keys, copy=True)
            del got
        end = time.monotonic()
    print(json.dumps({"bytes": nbytes * rounds, "start": start, "end": end}), flush=True)


def _aggregate_gbps(clients: int, address: str, keys_file: Path, rounds: int) -> float:
    """Aggregate copying-get GB/s of ``clients`` processes reading at once."""
    argv = [sys.executable, "-m", "bench.tiers_daemon", "--scaling-client", "--address", address,
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
    g1, gn = statistics.median(one), statistics.median(many)
    return {
        "concurrent_scaling": round(gn / g1, 2),
        "concurrent_clients": clients,
        "concurrent_get_gbps_1": round(g1, 3),
        f"concurrent_get_gbps_{clients}": round(gn, 3),
        "concurrent_loadavg_1m": round((load + os.getloadavg()[0]) / 2, 2),
    }


def measure_daemon(quick: bool, redis_url: str) -> dict[str, float | int | bool]:
    """Start a daemon, load it and Redis with the same blocks, time gets from another process."""
    import redis

    from kvstore.client import KVStoreClient

    n, rounds = (32, 5) if quick else (96, 9)
    blocks = _blocks(n)
    total = sum(len(b) for _, b in blocks)
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-daemon-") as tmp:
        proc, address = spawn_daemon(Path(tmp), "--cpu", str(max(total * 2, 64 << 20)))
        r = redis.Redis.from_url(redis_url)
        try:
            with KVStoreClient(address, deadline_s=60.0) as c:
                c.put_many(blocks)
            p = r.pipeline(transaction=False)
            for k, b in blocks:
                p.set(b"bench:" + k, b)
            p.execute()
            keys_file = Path(tmp) / "keys.json"
            keys_file.write_text(json.dumps({"keys": [k.hex() for k, _ in blocks], "sizes": [len(b) for _, b in blocks]}))
            out = subprocess.run(
                [sys.executable, "-m", "bench.tiers_daemon", "--client", "--address", address, "--redis", redis_url,
                 "--keys-file", str(keys_file), "--rounds", str(rounds)],
                capture_output=True, text=True, timeout=600, check=True,
            )  # fmt: skip
            scaling = measure_scaling(address, keys_file, rounds=rounds * 2)
        finally:
            r.delete(*[b"bench:" + k for k, _ in blocks])
            r.close()
            stop_daemon(proc)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    gbps = res["bytes"] / statistics.median(res["daemon_s"]) / 1e9
    redis_gbps = res["bytes"] / min(statistics.median(res["redis_loop_s"]), statistics.median(res["redis_pipe_s"])) / 1e9
    return {
        "get_gbps": round(gbps, 3),
        "redis_get_gbps": round(redis_gbps, 3),
        "vs_redis": round(gbps / redis_gbps, 2),
        "get_copy_gbps": round(res["bytes"] / statistics.median(res["copy_s"]) / 1e9, 3),
        # zero-copy read_many straight into a pre-faulted buffer (the connector's path)
        "get_into_gbps": round(res["bytes"] / statistics.median(res["into_s"]) / 1e9, 3),
        "blocks": n,
        "bytes": res["bytes"],
        "rounds": rounds,
        "shm": bool(res["shm"]),
        **scaling,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
