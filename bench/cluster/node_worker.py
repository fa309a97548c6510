"""A long-lived kvstore client inside a node's namespace: one put or read of blocks per stdin line.

``python -m bench.cluster.node_worker ADDRESS [--floats F] [--wait-s S] [--deadline-s D]``, then
lines ``put TAG COUNT`` or ``get TAG COUNT``; each answers one JSON line: node_client's ``put`` or
``get`` result (``get`` counts hits, misses and ``wrong``: blocks whose bytes differ from what was
written) plus ``s`` (seconds the operation took), or ``{"s", "error": "TypeName: message"}`` when
the client raised (the worker keeps serving: a daemon down or a deadline missed is an answer).

Why a process that stays: starting Python, numpy and gRPC costs about a second on a 2-core machine,
so a client per operation would measure its own start-up. bench/cluster/rounds.py keeps one per
node and sends every node its operation at once.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from bench.cluster.node_client import get, keys_of, put
from kvstore.client.client import KVStoreClient
from kvstore.client.retry import Retry


def serve(c: KVStoreClient, floats: int, wait_s: float) -> None:
    for line in sys.stdin:
        parts = line.split()
        if not parts:
            continue
        op, tag, count = parts[0], parts[1], int(parts[2])
        t0 = time.monotonic()
        try:
            keys = keys_of(tag, count)
            if op == "put":
                out: dict[str, object] = dict(put(c, keys, floats, wait_s))
            elif op == "get":
                out = get(c, keys, floats)
            else:
                out = {"error": f"ValueError: unknown op {op!r}"}
        except Exception as e:  # noqa: BLE001 - reported to the driver, the worker goes on
            out = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(json.dumps({"s": round(time.monotonic() - t0, 3), **out}), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cluster.node_worker")
    ap.add_argument("address")
    ap.add_argument("--floats", type=int, default=16 * 1024)  # 64 KiB blocks
    ap.add_argument("--wait-s", type=float, default=5.0, help="how long a put waits for its write-through")
    ap.add_argument("--deadline-s", type=float, default=10.0, help="each call's deadline")
    args = ap.parse_args(argv)
    with KVStoreClient(args.address, deadline_s=args.deadline_s, retry=Retry(attempts=2)) as c:
        serve(c, args.floats, args.wait_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
