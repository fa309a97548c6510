"""Daemon end to end vs Redis, for ``bench.tiers`` (key ``daemon`` of its JSON).

A ``kvstore serve`` subprocess (default cpu tier) and one redis-server listening on TCP and on a
unix socket (bench.tiers.redis_unix) are loaded with the same blocks: the block the connector
actually puts for the engine's default model (bench.tiers.engine_block: one KV page of SmolLM2-135M,
720 KiB of payload). Then a *separate client process* — the situation of an engine replica beside
the daemon — reads all blocks through ``KVStoreClient`` and through redis-py, rounds interleaved
so every side sees the same machine state, and reports the median throughput of each
(bench.tiers.figures). The Redis side is redis-py with hiredis and RedisTier's 1 MiB socket reads
(bench.tiers.baselines), the best of a GET loop, a pipelined GET batch and one MGET, all returning
fresh bytes, once over TCP and once over the unix socket.

Like for like (issue 23): the same transport and the same block size on both sides of a ratio.
- ``vs_redis`` (the headline): TCP against TCP. ``tcp_get_gbps / redis_get_gbps``: a client with
  ``use_shm=False`` (the daemon's raw TCP Get channel over loopback, ``get_many`` into buffers the
  caller owns) against redis-py over loopback TCP.
- ``vs_redis_unix``: shared memory against Redis's best same-host transport, a unix socket:
  ``get_copy_gbps / redis_unix_get_gbps``.
- ``vs_redis_mixed``: ``get_copy_gbps / redis_get_gbps``, shared memory against Redis over TCP:
  the headline until issue 23 (4.63 at 32c6760, then with 0.5-2 MB blocks and the TCP client's
  4 MiB ones), kept only as a labelled breakdown. ``vs_redis_into`` / ``vs_redis_views``: the
  pool-copy and view paths against Redis over TCP, as before.
- ``get_gbps``: ``get_many`` (read-only views of the shared segment); ``get_copy_gbps``: with
  ``copy=True`` (fresh bytes, like redis-py's); ``get_into_gbps``: ``read_many`` into a pre-faulted
  buffer, as the connector copies into its pool; ``tcp_get_gbps`` / ``tcp_into_gbps``: the TCP
  client's ``get_many`` / ``read_many`` (until issue 23 over 4 MiB blocks).
- ``concurrent_scaling``: aggregate ``get_many(copy=True)`` GB/s (bytes the callers own) of 4
  client *processes* (one GIL each) on the one daemon, divided by that of 1 client. Each client
  reads every block ``rounds`` times once all are ready; aggregate = all bytes / (last end - first
  start). 1- and 4-client runs alternate, 3 of each, medians compared; the load average is
  recorded, since the machine may be shared.

    python -m bench.tiers.daemon [--quick]
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
from bench.tiers.engine_block import encoded_blocks, engine_block

LOOPBACK = "127.0.0.1"


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


def _redis_passes(r: Any, rkeys: list[bytes]) -> dict[str, Callable[[], object]]:
    """The Redis baselines over one client: a GET loop, a pipelined GET batch, one MGET."""
    def pipelined() -> list[bytes]:
        p = r.pipeline(transaction=False)
        for k in rkeys:
            p.get(k)
        return p.execute()

    return {"loop": lambda: [r.get(k) for k in rkeys], "pipe": pipelined, "mget": lambda: r.mget(rkeys)}


def _client_main(address: str, redis_tcp: str, redis_unix: str, keys_file: str, rounds: int) -> None:
    """Runs in the separate client process: prints one JSON line of timings."""
    from bench.tiers.baselines import redis_client_like
    from kvstore.client.client import KVStoreClient

    spec = json.loads(Path(keys_file).read_text())
    keys = [bytes.fromhex(k) for k in spec["keys"]]
    rkeys = [b"bench:" + k for k in keys]
    r, ru = redis_client_like(redis_tcp), redis_client_like(redis_unix)
    with KVStoreClient(address, deadline_s=30.0) as c, KVStoreClient(address, deadline_s=60.0, use_shm=False) as tcp:
        got = _copied(tcp, keys)  # warm-up + correctness, the streamed client first:
        assert [len(g) if g else 0 for g in got] == spec["sizes"], "daemon (tcp) returned wrong blocks"
        tcp_shm = _maps_shm()  # ... so that a segment mapped now is its own
        got = _copied(c, keys)
        assert [len(g) if g else 0 for g in got] == spec["sizes"], "daemon returned wrong blocks"
        for client in (r, ru):
            assert [len(v or b"") for v in client.mget(rkeys)] == spec["sizes"], "redis returned wrong blocks"
        shm = _maps_shm()
        del got
        into, tcp_into = _pool_sink(spec["sizes"]), _pool_sink(spec["sizes"])
        passes: dict[str, Callable[[], object]] = {
            "copy": lambda: _copied(c, keys),
            "into": lambda: c.read_batches(keys, into),
            "views": lambda: c.read_batches(keys, lambda items: None),  # views, valid during the call
            "tcp_get": lambda: _copied(tcp, keys),
            "tcp_into": lambda: tcp.read_batches(keys, tcp_into),
            **{f"redis_{n}": f for n, f in _redis_passes(r, rkeys).items()},
            **{f"redisu_{n}": f for n, f in _redis_passes(ru, rkeys).items()},
        }
        t: dict[str, list[float]] = {n: [] for n in passes}
        for i in range(rounds):
            names = list(passes) if i % 2 == 0 else list(reversed(passes))  # no side always runs first
            for name in names:
                t[name].append(_timed(passes[name]))
    r.close()
    ru.close()
    print(json.dumps({"bytes": sum(spec["sizes"]), "s": t, "shm": shm, "tcp_shm": tcp_shm}))


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


def _best_redis(s: dict[str, list[float]], prefix: str) -> tuple[str, list[float]]:
    return fig.best_baseline({"get_loop": s[f"{prefix}_loop"], "pipelined_get": s[f"{prefix}_pipe"],
                              "mget": s[f"{prefix}_mget"]})


def figures(res: dict[str, Any]) -> dict[str, Any]:
    """The daemon's figures from the client process's timings (see the module docstring)."""
    s, n = res["s"], res["bytes"]
    best, best_s = _best_redis(s, "redis")
    best_u, best_us = _best_redis(s, "redisu")
    return {
        "vs_redis": round(fig.ratio_of_medians(s["tcp_get"], best_s), 2),
        "vs_redis_path": "TCP against TCP: the daemon's TCP Get channel (use_shm=False, get_many -> buffers the "
                         "caller owns) against redis-py over loopback TCP (fresh bytes)",
        "vs_redis_paired": round(fig.paired_ratio(s["tcp_get"], best_s), 2),
        "vs_redis_unix": round(fig.ratio_of_medians(s["copy"], best_us), 2),
        "vs_redis_unix_path": "shared memory against a unix socket: get_many(copy=True) against redis-py over "
                              "Redis's unix socket (both fresh bytes)",
        "vs_redis_unix_paired": round(fig.paired_ratio(s["copy"], best_us), 2),
        "vs_redis_mixed": round(fig.ratio_of_medians(s["copy"], best_s), 2),
        "vs_redis_mixed_path": "shared memory against TCP (the headline until issue 23): a breakdown, not like for like",
        "vs_redis_into": round(fig.ratio_of_medians(s["into"], best_s), 2),
        "vs_redis_views": round(fig.ratio_of_medians(s["views"], best_s), 2),
        "get_gbps": round(fig.gbps(n, s["views"]), 3),
        "get_copy_gbps": round(fig.gbps(n, s["copy"]), 3),
        "get_into_gbps": round(fig.gbps(n, s["into"]), 3),
        "tcp_get_gbps": round(fig.gbps(n, s["tcp_get"]), 3),
        "tcp_into_gbps": round(fig.gbps(n, s["tcp_into"]), 3),
        "tcp_path": "use_shm=False: raw TCP Get channel over loopback, get_many -> buffers the caller owns",
        "tcp_shm": bool(res["tcp_shm"]),
        "redis_get_gbps": round(fig.gbps(n, best_s), 3),
        "redis_baseline": f"redis-py {best} over loopback TCP (hiredis, 1 MiB socket reads), fresh bytes",
        "redis_get_loop_gbps": round(fig.gbps(n, s["redis_loop"]), 3),
        "redis_pipeline_gbps": round(fig.gbps(n, s["redis_pipe"]), 3),
        "redis_mget_gbps": round(fig.gbps(n, s["redis_mget"]), 3),
        "redis_unix_get_gbps": round(fig.gbps(n, best_us), 3),
        "redis_unix_baseline": f"redis-py {best_u} over Redis's unix socket (hiredis, 1 MiB socket reads), fresh bytes",
    }


@dataclass(frozen=True)
class Plan:
    blocks: int  # engine-sized blocks read by every client
    rounds: int
    scaling_reps: int = 3
    scaling_clients: int = 4


QUICK, FULL = Plan(blocks=32, rounds=5), Plan(blocks=96, rounds=9)


def measure_daemon(quick: bool, plan: Plan | None = None) -> dict[str, Any]:
    """Start a daemon and a Redis (TCP and unix socket), load both with the same engine-sized
    blocks, time gets from another process."""
    from bench.tiers.baselines import redis_client_like
    from bench.tiers.redis_unix import redis_tcp_and_unix
    from kvstore.client.client import KVStoreClient

    plan = plan or (QUICK if quick else FULL)
    n, rounds = plan.blocks, plan.rounds
    spec = engine_block()
    blocks = encoded_blocks(spec, n)
    total = sum(len(b) for _, b in blocks)
    with tempfile.TemporaryDirectory(prefix="tierkv-bench-daemon-") as tmp, redis_tcp_and_unix() as urls:
        proc, address = spawn_daemon(Path(tmp), "--cpu", str(max(total * 2, 64 << 20)))
        r = redis_client_like(urls.tcp)
        try:
            with KVStoreClient(address, deadline_s=60.0) as c:
                c.put_many(blocks)
            r.mset({b"bench:" + k: b for k, b in blocks})
            keys_file = Path(tmp) / "keys.json"
            keys_file.write_text(json.dumps({"keys": [k.hex() for k, _ in blocks], "sizes": [len(b) for _, b in blocks]}))
            out = subprocess.run(
                [sys.executable, "-m", "bench.tiers.daemon", "--client", "--address", address, "--redis", urls.tcp,
                 "--redis-unix", urls.unix, "--keys-file", str(keys_file), "--rounds", str(rounds)],
                capture_output=True, text=True, timeout=600, check=True,
            )  # fmt: skip
            scaling = measure_scaling(address, keys_file, rounds=rounds * 2, clients=plan.scaling_clients,
                                      reps=plan.scaling_reps)
        finally:
            r.close()
            stop_daemon(proc)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return {
        **figures(res),
        "blocks": n,
        "block_bytes": len(blocks[0][1]),
        "block_payload_bytes": spec.payload_bytes,
        "block_shape": list(spec.shape),
        "block_model": spec.model,
        "bytes": res["bytes"],
        "rounds": rounds,
        "shm": bool(res["shm"]),
        **scaling,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.tiers.daemon", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--scaling-client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--address", help=argparse.SUPPRESS)
    ap.add_argument("--redis", help=argparse.SUPPRESS)
    ap.add_argument("--redis-unix", help=argparse.SUPPRESS)
    ap.add_argument("--keys-file", help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=5, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        _client_main(args.address, args.redis, args.redis_unix, args.keys_file, args.rounds)
        return
    if args.scaling_client:
        _scaling_client_main(args.address, args.keys_file, args.rounds)
        return
    print(json.dumps(measure_daemon(args.quick), indent=2))


if __name__ == "__main__":
    main()
