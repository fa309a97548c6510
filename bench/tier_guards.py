"""What the shared tiers' guards cost per block: ``python -m bench.tier_guards [--out F.json] [--reps N] [--redis]``.

The MAC (tiers/mac.py) and, with ``--redis``, the bounded read (a real redis-server on loopback:
RedisTier.get with ``max_value_bytes``, one GETRANGE, against the same tier without it, one GET,
interleaved, the same blocks). S3's bound costs nothing to measure: it reads a header the response
already carries.

Two block sizes: 720 KiB (one 16-token page of SmolLM2-135M in fp32, 737,280 bytes) and 4 MiB.
Per block, in the same run and interleaved (each repetition times every case once, one after the
other, so the machine's load falls on all of them alike), the median over ``reps`` warmed
repetitions of:

  memcpy            a numpy copy of the block (the floor of moving its bytes once)
  xxh3              the block checksum every read already verifies (kvstore/block.py)
  blake2b_keyed     the tag alone, keyed BLAKE2b-256 (the alternative)
  hmac_sha256       the tag alone, HMAC-SHA256 over the same input (what tiers/mac.py uses)
  seal              what a write adds: tag + the copy that appends the trailer (BlockMac.seal)
  open              what a read adds: parse + verify the trailer (BlockMac.open)
  open_and_copy     open + the copy of the block without its trailer that the store then takes

``meta`` records the load average before and after, the cores, Python and OpenSSL versions.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import ssl
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import xxhash

from tiers.mac import BlockMac

SIZES = {"720KiB": 30 * 2 * 16 * 3 * 64 * 4, "4MiB": 4 * 1024**2}
KEY = bytes(range(16))


def _cases(block: bytes, mac: BlockMac) -> dict[str, Callable[[], object]]:
    dst = np.empty(len(block), dtype=np.uint8)
    src = np.frombuffer(block, dtype=np.uint8)
    hkey = hashlib.blake2b(b"k" * 40, digest_size=32).digest()
    sealed = mac.seal(KEY, block)

    def open_and_copy() -> object:
        body, fault = mac.open(KEY, sealed)
        assert fault is None
        return bytes(body)

    return {
        "memcpy": lambda: np.copyto(dst, src),
        "xxh3": lambda: xxhash.xxh3_64_intdigest(block),
        "blake2b_keyed": lambda: hashlib.blake2b(block, digest_size=32, key=hkey).digest(),
        "hmac_sha256": lambda: hmac.new(hkey, block, hashlib.sha256).digest(),
        "seal": lambda: mac.seal(KEY, block),
        "open": lambda: mac.open(KEY, sealed),
        "open_and_copy": open_and_copy,
    }


def _time(fn: Callable[[], object], inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def run(reps: int) -> dict:
    mac = BlockMac(b"s" * 43, [b"p" * 43])
    out: dict = {"meta": {"loadavg_before": os.getloadavg(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
                          "openssl": ssl.OPENSSL_VERSION, "reps": reps}}
    for name, size in SIZES.items():
        block = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
        cases = _cases(block, mac)
        inner = max(1, (8 * 1024**2) // size)
        for fn in cases.values():  # warm up
            _time(fn, inner)
        samples: dict[str, list[float]] = {c: [] for c in cases}
        for _ in range(reps):
            for c, fn in cases.items():
                samples[c].append(_time(fn, inner))
        med = {c: statistics.median(v) for c, v in samples.items()}
        out[name] = {
            "bytes": size,
            "us": {c: round(t * 1e6, 1) for c, t in med.items()},
            "gbps": {c: round(size / t / 1e9, 2) for c, t in med.items()},
        }
    out["meta"]["loadavg_after"] = os.getloadavg()
    return out


def run_redis(reps: int) -> dict:
    """RedisTier.get of each block size, bounded (GETRANGE) and not (GET), microseconds per get."""
    from bench.servers import redis_server
    from tiers.redis import RedisTier

    out: dict = {}
    with redis_server() as url:
        for name, size in SIZES.items():
            block = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
            with RedisTier(url, 1 << 30, prefix=b"plain:") as plain, \
                    RedisTier(url, 1 << 30, prefix=b"bound:", max_value_bytes=64 << 20) as bound:  # fmt: skip
                plain.put(KEY, block)
                bound.put(KEY, block)
                cases = {"get": lambda t=plain: t.get(KEY), "getrange_bounded": lambda t=bound: t.get(KEY)}
                inner = max(1, (16 * 1024**2) // size)
                for fn in cases.values():
                    _time(fn, inner)
                samples: dict[str, list[float]] = {c: [] for c in cases}
                for _ in range(reps):
                    for c, fn in cases.items():
                        samples[c].append(_time(fn, inner))
                med = {c: statistics.median(v) for c, v in samples.items()}
                out[name] = {"us": {c: round(t * 1e6, 1) for c, t in med.items()},
                             "bounded_over_get": round(med["getrange_bounded"] / med["get"], 3)}
                plain.delete(KEY)
                bound.delete(KEY)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tier_guards", description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--redis", action="store_true", help="also time bounded Redis reads on a local redis-server")
    p.add_argument("--out", help="write the figures as JSON here too")
    args = p.parse_args(argv)
    res = run(args.reps)
    if args.redis:
        res["redis"] = run_redis(args.reps)
        res["meta"]["loadavg_after"] = os.getloadavg()
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
