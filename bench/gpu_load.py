"""Host -> GPU figures for bench/gpu_check.sh: ``python -m bench.gpu_load --out F.json``.

Two measurements against a kvstore daemon with a cpu tier, started here on loopback:
  load   the connector's Loader filling a GPU KV pool from the daemon (shared memory -> one-page
         host staging, copied and checksummed in one pass -> upload), against a plain pinned
         ``torch`` host->device copy of the same bytes; medians of ``reps`` warmed loads.
  ttft   bench.e2e's headline on this device: cold TTFT (full prefill) against warm TTFT with the
         prefix loaded from the daemon's cpu tier, and whether the greedy tokens are identical.
``--device cpu --doc-tokens 64 --pages 4 --reps 1`` is the dry run bench/gpu_check.sh tests on CPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.e2e.headline import headline
from bench.e2e.support import Bench, kv_daemon
from connector import native
from connector.loader import Loader
from engine.kv_pool import KVPool
from engine.model_loader import load_model
from kvstore.block import encode_block
from kvstore.client.client import KVStoreClient
from kvstore.keys import BlockKey

PAGE_SIZE = 16


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def load_bandwidth(address: str, arch, device: torch.device, pages: int, reps: int) -> dict:
    pool = KVPool(arch, num_pages=pages, page_size=PAGE_SIZE, dtype=torch.float32, device=device)
    rng = np.random.default_rng(5)
    keys = [BlockKey(b"gpu-load-%08d" % i) for i in range(pages)]
    items = [(k, encode_block(k, rng.standard_normal(pool.block_shape()).astype(np.float32), layout="LKTHD"))
             for k in keys]
    nbytes = pages * pool.bytes_per_page
    with KVStoreClient(address) as client:
        client.put_many(items)
        loader = Loader(client, pool, chunk_bytes=32 * 2**20)
        times, ok = [], 0
        for i in range(reps + 1):  # the first is a warm-up
            _sync(device)
            t0 = time.perf_counter()
            res = loader.load(keys, list(range(pages)), deadline_s=120.0)
            _sync(device)
            if i:
                times.append(time.perf_counter() - t0)
            ok = res.pages_ok
    want = torch.from_numpy(np.frombuffer(items[-1][1][-pool.bytes_per_page:], dtype=np.float32).copy())
    identical = ok == pages and torch.equal(pool.read_pages([pages - 1])[0].reshape(-1), want)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    base = []
    for i in range(reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        _sync(device)
        if i:
            base.append(time.perf_counter() - t0)
    conn, plain = nbytes / statistics.median(times) / 1e9, nbytes / statistics.median(base) / 1e9
    return {"bytes": nbytes, "pages_loaded": ok, "last_page_identical": identical, "connector_gbps": conn,
            "pinned_copy_gbps": plain, "connector_over_pinned": conn / plain, "load_runs_s": times,
            "pinned_runs_s": base}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="", help="model directory (default: SmolLM2-135M)")
    ap.add_argument("--pages", type=int, default=512, help="pages per load (16 tokens each)")
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench.gpu_load: no CUDA device (use --device cpu for a dry run)", file=sys.stderr)
        return 2
    from connector.calibrate import calibrate_prefill

    loaded = load_model(a.model)
    result: dict = {"device": str(device), "implementation": native.status()._asdict()}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    with tempfile.TemporaryDirectory(prefix="tierkv-gpu-") as tmp, \
            kv_daemon(Path(tmp) / "cpu", "--cpu", "4GiB") as address:
        result["load"] = load_bandwidth(address, loaded.arch, device, a.pages, a.reps)
        b = Bench(loaded, threads=torch.get_num_threads())
        b.prefill = calibrate_prefill(b.engine(256).view)
        h = headline(b, {"cpu": address}, a.doc_tokens, a.reps)
    result["ttft"] = {"prompt_tokens": h["prompt_tokens"], "cold_ttft_s": h["cold_ttft_s"],
                      "warm_ttft_cpu_tier_s": h["warm_ttft_s"]["cpu"], "speedup": h["speedup_cpu"],
                      "kv_bytes_loaded": h["kv_bytes_loaded"], "fidelity_identical": h["fidelity_identical"],
                      "decision": h["decisions"].get("cpu")}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2, default=float) + "\n")
    print(json.dumps(result, indent=2, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
