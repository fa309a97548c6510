"""Data-path ops, native and fallback, next to memcpy in the same run: ``python -m bench.kernels --out F.json``.

Shape: SmolLM2-135M's KV (30 layers x 2 x 16 tokens x 3 heads x 64 x fp32 per page, 737 KB),
one block per page as the connector stores them, a 2k-token hit (128 pages) per pass with
``--quick`` (512 pages without). Every pass moves the same bytes:
  memcpy         numpy copy of the pass's bytes between two buffers (the floor: bytes / bandwidth)
  unpack_verify  each block's payload (its own bytes object, as a received block) -> a pool page,
                 pages in shuffled order, checksum of the copy checked against the header
                 (``per_block_copy_gbps``: the same copies as numpy assignments, one per block, no
                 checksum: what one call per block into 60 scattered 12 KiB page rows costs by itself)
  pack_checksum  each pool page -> its own preallocated block payload, checksum returned
  unpack_verify_batch / pack_checksum_batch  the same blocks in one call (connector/native_batch.py)
                 on ``threads`` threads (``native_1thread_gbps``: on one); fallback: the per-block
                 fallback loop
  rope_rerotate  CacheBlend's K re-rotation of a 2k-token prompt's K ([30, 2048, 3, 64] fp32, in
                 place natively; fallback: the torch version), GB/s of K
The pool is a torch tensor, as the engine's KV pool is (64-byte aligned: the non-temporal
stores need it). Each repetition times memcpy and every op once, one after the other (on a
shared box the load drifts between sections; interleaving puts memcpy and the ops under the same
load). Figures are medians over ``reps`` warmed repetitions (GB/s = pass bytes / time);
``paired_native_over_memcpy`` is the median over repetitions of memcpy time / native time of the
same repetition. ``meta`` records the implementation and hash kernel that ran, cores, load
average before and after, git revision.
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
import torch

from connector import native, native_batch, native_lib, native_rope
from engine.rope import Rotary
from kvstore.block import encode_block, read_header

LAYERS, PAGE, HEADS, DIM, ITEM = 30, 16, 3, 64, 4
SEG = PAGE * HEADS * DIM * ITEM


def _rope_case(tokens: int) -> tuple[torch.Tensor, native_rope.Tables]:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(LAYERS, tokens, HEADS, DIM, generator=g)
    rotary = Rotary(DIM, 10000.0, 2 * tokens + 64)
    new = torch.arange(tokens)
    cos_o, sin_o = rotary.cos_sin(new + 37)
    cos_n, sin_n = rotary.cos_sin(new)
    return k, (cos_o, -sin_o, cos_n, sin_n)


def run(pages: int, reps: int) -> dict:
    rng = np.random.default_rng(0)
    pool = torch.from_numpy(rng.integers(0, 256, (LAYERS, 2, 2 * pages, SEG), dtype=np.uint8)).clone().numpy()
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
    threads = native.default_threads()
    rope_k, rope_tables = _rope_case(16 * pages)
    rope_buf = rope_k.clone()

    def unpack(use_native: bool) -> Callable[[], None]:
        def go() -> None:
            for h, p, page in zip(headers, payloads, targets, strict=True):
                native.unpack_verify(h, p, pool, [page], use_native=use_native)
        return go

    payload_arrays = [np.frombuffer(p, np.uint8).reshape(LAYERS, 2, SEG) for p in payloads]

    def copy_per_block() -> None:
        for a, page in zip(payload_arrays, targets, strict=True):
            pool[:, :, page] = a

    def pack(use_native: bool) -> Callable[[], None]:
        def go() -> None:
            for pre, out, page in zip(prefixes, outs, targets, strict=True):
                native.pack_checksum(pre, pool, [page], out, use_native=use_native)
        return go

    def unpack_batch(n: int) -> Callable[[], None]:
        def go() -> None:
            assert all(native_batch.unpack_verify_many(headers, payloads, pool, targets, threads=n, use_native=True))
        return go

    def pack_batch(n: int) -> Callable[[], None]:
        return lambda: native_batch.pack_checksum_many(prefixes, pool, targets, outs, threads=n, use_native=True)

    cases: dict[str, Callable[[], object]] = {
        "memcpy": lambda: np.copyto(dst, src),
        "unpack_verify/native": unpack(True), "unpack_verify/fallback": unpack(False),
        "unpack_copy/numpy": copy_per_block,
        "pack_checksum/native": pack(True), "pack_checksum/fallback": pack(False),
        "unpack_verify_batch/native": unpack_batch(threads), "unpack_verify_batch/native1": unpack_batch(1),
        "pack_checksum_batch/native": pack_batch(threads), "pack_checksum_batch/native1": pack_batch(1),
        "rope_rerotate/native": lambda: native_rope.rerotate(rope_buf, rope_tables, use_native=True),
        "rope_rerotate/fallback": lambda: native_rope.rerotate_torch(rope_k, rope_tables),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for rep in range(reps + 1):  # repetition 0 warms up (page faults, caches, lazy loading)
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            if rep:
                times[name].append(time.perf_counter() - t0)

    def gbps(name: str, size: int = nbytes) -> float:
        return size / statistics.median(times[name]) / 1e9

    def paired(name: str) -> float:
        return statistics.median(m / t for m, t in zip(times["memcpy"], times[name], strict=True))

    memcpy = gbps("memcpy")
    ops = {}
    for op in ("unpack_verify", "pack_checksum"):
        nat, fb = gbps(f"{op}/native"), gbps(f"{op}/fallback")
        ops[op] = {"native_gbps": nat, "fallback_gbps": fb, "native_over_memcpy": nat / memcpy,
                   "paired_native_over_memcpy": paired(f"{op}/native"), "native_over_fallback": nat / fb}
        nat_b, one = gbps(f"{op}_batch/native"), gbps(f"{op}_batch/native1")
        ops[f"{op}_batch"] = {"native_gbps": nat_b, "native_1thread_gbps": one, "threads": threads,
                              "fallback_gbps": fb, "native_over_memcpy": nat_b / memcpy,
                              "paired_native_over_memcpy": paired(f"{op}_batch/native"),
                              "native_over_fallback": nat_b / fb}
    per_block = gbps("unpack_copy/numpy")
    ops["unpack_verify"].update(per_block_copy_gbps=per_block,
                                native_over_per_block_copy=ops["unpack_verify"]["native_gbps"] / per_block)
    k_bytes = rope_k.numel() * rope_k.element_size()
    nat, fb = gbps("rope_rerotate/native", k_bytes), gbps("rope_rerotate/fallback", k_bytes)
    ops["rope_rerotate"] = {"native_gbps": nat, "fallback_gbps": fb, "native_over_fallback": nat / fb,
                            "native_over_memcpy": nat / memcpy, "k_bytes": k_bytes, "tokens": rope_k.shape[1]}
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
    res["meta"] = {"implementation": st.impl, "kernel": native_lib.kernel(),
                   "kernels_supported": native_lib.supported_kernels(), "cores": os.cpu_count(),
                   "load_avg_before": load_before,
                   "load_avg_after": os.getloadavg()[0], "git": _git_rev(), "quick": args.quick}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
