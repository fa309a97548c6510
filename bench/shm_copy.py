"""``python -m bench.shm_copy``: what a tenant pays for not being handed the daemon's arena.

A caller that may read every block is answered in place: the daemon copies nothing, the client
copies each block out of the arena into its own memory. A tenant of a multi-tenant daemon is
never handed the arena (kvstore/server/credentials.py): the daemon copies each block into the
tenant's segment, and the client copies it out of there. Both paths are measured here on the
same daemon (``kvstore serve``, another process), the same client process and the same blocks:
the KV of a ``--tokens``-token prompt of SmolLM2-135M in fp32 (16-token pages, 737,280-byte
blocks), read with one Get and copied into a preallocated destination as the connector copies
into its pool. A tenant's path is the client with ``use_arena=False``: the daemon then copies
every block into the segment, exactly what it does for a caller that does not see all.

Medians of ``--reps`` interleaved, warmed rounds; the load average is recorded beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.servers import spawn_daemon, stop_daemon
from kvstore.block import encode_block
from kvstore.client.client import KVStoreClient

PAGE = (30, 2, 16, 3, 64)  # SmolLM2-135M, one 16-token page: layers, K/V, tokens, kv heads, head dim


def _blocks(tokens: int) -> list[tuple[bytes, bytes]]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(tokens // PAGE[2]):
        key = b"shm-copy-%07d" % i
        out.append((key, encode_block(key, rng.standard_normal(PAGE, dtype=np.float32))))
    return out


def _read(c: KVStoreClient, keys: list[bytes], dst: np.ndarray, step: int) -> float:
    def consume(items: list[tuple[int, memoryview]]) -> None:
        for i, mv in items:
            np.copyto(dst[i * step : i * step + mv.nbytes], np.frombuffer(mv, np.uint8))

    t0 = time.perf_counter()
    found = c.read_batches(keys, consume)
    dt = time.perf_counter() - t0
    assert all(found)
    return dt


def run(tokens: int, reps: int) -> dict:
    blocks = _blocks(tokens)
    keys = [k for k, _ in blocks]
    step = max(len(v) for _, v in blocks)
    total = sum(len(v) for _, v in blocks)
    dst = np.zeros(step * len(blocks), dtype=np.uint8)
    with tempfile.TemporaryDirectory(prefix="tierkv-shm-copy-") as tmp:
        proc, address = spawn_daemon(Path(tmp), "--cpu", f"{(total >> 20) + 64}MiB", "--no-stream")
        try:
            with KVStoreClient(address, use_shm=True, use_arena=True) as in_place, \
                    KVStoreClient(address, use_shm=True, use_arena=False) as copied:  # fmt: skip
                in_place.put_many(blocks)
                times: dict[str, list[float]] = {"in_place": [], "copied": []}
                for r in range(reps + 1):  # the first round warms both
                    for name, c in (("in_place", in_place), ("copied", copied)):
                        dt = _read(c, keys, dst, step)
                        if r:
                            times[name].append(dt)
                assert in_place.arena_active and not copied.arena_active
        finally:
            stop_daemon(proc)
    med = {k: statistics.median(v) for k, v in times.items()}
    floor = total / 9e9  # one memcpy of the bytes at ~9 GB/s (docs: DESIGN physics)
    return {
        "tokens": tokens, "blocks": len(blocks), "bytes": total, "reps": reps, "loadavg": os.getloadavg(),
        "median_s": med, "times_s": times, "copied_over_in_place": med["copied"] / med["in_place"],
        "extra_ms": (med["copied"] - med["in_place"]) * 1e3, "one_memcpy_floor_ms": floor * 1e3,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    res = run(args.tokens, args.reps)
    text = json.dumps(res, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
