"""A kvstore client run inside a node's namespace: put or read a set of blocks, print a JSON line.

``python -m bench.cluster.node_client ADDRESS put|get|lookups --tag T --count N [--floats F]``

Why a process: the daemon of a node listens inside that node's namespace, and gRPC opens its
connections from threads of its own, so a client has to live in the namespace whole (started with
``ip netns exec``), not in one thread of the test. Every block's bytes follow from its key, so the
reader knows what is right: ``get`` counts hits, misses and wrong blocks (other bytes than written).

- ``put``: ``put_many``, then waits until the daemon has written everything through to its shared
  tiers (``pending_blocks`` 0); prints ``{"put": ok, "pending": left}``.
- ``get``: ``lookup`` (which tier each block is in) and ``read_batches``; prints ``{"hits", "misses",
  "wrong", "tiers"}`` (``tiers``: how many blocks each tier answered).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections import Counter

import numpy as np

from kvstore.block import encode_block
from kvstore.client.client import KVStoreClient


def keys_of(tag: str, count: int) -> list[bytes]:
    return [f"{tag}-{i:05d}".encode() for i in range(count)]


def block_of(key: bytes, floats: int) -> bytes:
    rng = np.random.default_rng(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))  # same in every process
    return encode_block(key, rng.standard_normal(floats, dtype=np.float32))


def put(c: KVStoreClient, keys: list[bytes], floats: int, wait_s: float) -> dict[str, int]:
    ok = sum(c.put_many([(k, block_of(k, floats)) for k in keys]))
    deadline = time.monotonic() + wait_s
    while (pending := c.stats().pending_blocks) and time.monotonic() < deadline:
        time.sleep(0.05)
    return {"put": ok, "pending": pending}


def get(c: KVStoreClient, keys: list[bytes], floats: int) -> dict[str, object]:
    tiers = Counter(t or "miss" for t in c.lookup(keys).tiers)
    got: list[bytes | None] = [None] * len(keys)

    def sink(items: list[tuple[int, memoryview]]) -> None:
        for i, view in items:
            got[i] = bytes(view)

    c.read_batches(keys, sink)
    hits = sum(g is not None for g in got)
    wrong = sum(g is not None and g != block_of(k, floats) for k, g in zip(keys, got, strict=True))
    return {"hits": hits, "misses": len(keys) - hits, "wrong": wrong, "tiers": dict(tiers)}


def lookups(c: KVStoreClient, count: int) -> None:
    for line in sys.stdin:
        t0 = time.monotonic()
        try:
            out: dict[str, object] = {"tiers": [t or "miss" for t in c.lookup(keys_of(line.strip(), count)).tiers]}
        except Exception as e:  # noqa: BLE001 - reported, the session goes on
            out = {"error": type(e).__name__}
        print(json.dumps({"s": round(time.monotonic() - t0, 3), **out}), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cluster.node_client")
    ap.add_argument("address")
    ap.add_argument("op", choices=("put", "get", "lookups"))
    ap.add_argument("--tag", required=True)
    ap.add_argument("--count", type=int, default=16)
    ap.add_argument("--floats", type=int, default=16 * 1024)  # 64 KiB blocks
    ap.add_argument("--wait-s", type=float, default=30.0)
    args = ap.parse_args(argv)
    keys = keys_of(args.tag, args.count)
    with KVStoreClient(args.address, deadline_s=args.wait_s) as c:
        if args.op == "lookups":
            lookups(c, args.count)
            return 0
        out = put(c, keys, args.floats, args.wait_s) if args.op == "put" else get(c, keys, args.floats)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
