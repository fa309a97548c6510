"""Data-path ops, native and fallback, next to memcpy in the same run: ``python -m bench.kernels --out F.json``.

Shape: SmolLM2-135M's KV (30 layers x 2 x 16 tokens x 3 heads x 64 x fp32 per page, 737 KB),
one block per page as the connector stores them, a 2k-token hit (128 pages) per pass with
``--quick`` (512 pages without). Every pass moves the same bytes:
  memcpy         numpy copy of the pass's bytes between two buffers (the floor: bytes / bandwidth)
  unpack_verify  each block's payload (its own bytes object, as a received block) -> a pool page,
                 pages in shuffled order, checksum of the copy checked against the header
  pack_checksum  each pool page -> its own preallocated block payload, checksum returned
Each repetition times memcpy and every op once, one after the other (on a shared box the load
drifts between sections; interleaving puts memcpy and the ops under the same load). Figures are
medians over ``reps`` warmed repetitions (GB/s = pass bytes / time); ``paired_native_over_memcpy``
is the median over repetitions of memcpy time / native time of the same repetition. ``meta``
records the implementation that ran, cores, load average before and after, git revision.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from connector import native
from kvstore.block import encode_block, read_header

LAYERS, PAGE, HEADS, DIM, ITEM = 30, 16, 3, 64, 4
SEG = PAGE * HEADS * DIM * ITEM


def run(pages: int, reps: int) -> dict:
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 256, (LAYERS, 2, 2 * pages, SEG), dtype=np.uint8)
    targets = [int(p) for p in rng.permutation(2 * pages)[:pages]]
    blocks = [encode_block(b"bench-%08d" % i, rng.integers(0, 256, (LAYERS, 2, 1, SEG), dtype=np.uint8))
              for i in range(pages)]
    headers = [read_header(b) for b in blocks]
    payloads = [memoryview(b)[h.size :] for b, h in zip(blocks, headers, strict=True)]
    prefixes = [native.hashed_header(h.raw) for h in headers]
    outs = [np.empty(LAYERS * 2 * SEG, np.uint8) for _ in range(pages)]
    nbytes = pages * LAYERS * 2 * SEG
    src = rng.integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)

    def unpack(use_native: bool) -> Callable[[], None]:
        def go() -> None:
            for h, p, page in zip(headers, payloads, targets, strict=True):
                native.unpack_verify(h, p, pool, [page], use_native=use_native)
        return go

    def pack(use_native: bool) -> Callable[[], None]:
        def go() -> None:
            for pre, out, page in zip(prefixes, outs, targets, strict=True):
                native.pack_checksum(pre, pool, [page], out, use_native=use_native)
        return go

    cases: dict[str, Callable[[], object]] = {
        "memcpy": lambda: np.copyto(dst, src),
        "unpack_verify/native": unpack(True), "unpack_verify/fallback": unpack(False),
        "pack_checksum/native": pack(True), "pack_checksum/fallback": pack(False),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(reps + 1):  # repetition 0 warms up (page faults, caches, lazy loading)
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            if rep:
                times[name].append(time.perf_counter() - t0)

    def gbps(name: str) -> float:
        return nbytes / statistics.median(times[name]) / 1e9

    memcpy = gbps("memcpy")
    ops = {}
    for op in ("unpack_verify", "pack_checksum"):
        nat, fb = gbps(f"{op}/native"), gbps(f"{op}/fallback")
        paired = statistics.median(m / t for m, t in zip(times["memcpy"], times[f"{op}/native"], strict=True))
        ops[op] = {"native_gbps": nat, "fallback_gbps": fb, "native_over_memcpy": nat / memcpy,
                   "paired_native_over_memcpy": paired, "native_over_fallback": nat / fb}
    return {"memcpy_gbps": memcpy, "ops": ops, "pass_bytes": nbytes, "pages": pages, "reps": reps}


def _git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="a 2k-token hit (128 pages), 5 passes")
    args = ap.parse_args(argv)
    st = native.status()
    if st.impl != "native":
        print(f"bench.kernels: native ops unavailable ({st.reason}); build them first "
              "(pip install -e . or python setup.py build_ext --inplace)", file=sys.stderr)
        return 2
    load_before = os.getloadavg()[0]
    res = run(pages=128 if args.quick else 512, reps=5 if args.quick else 9)
    res["meta"] = {"implementation": st.impl, "cores": os.cpu_count(), "load_avg_before": load_before,
                   "load_avg_after": os.getloadavg()[0], "git": _git_rev(), "quick": args.quick}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
