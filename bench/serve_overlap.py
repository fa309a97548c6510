"""``python -m bench.serve_overlap``: would a layer-by-layer overlap of load and compute pay here?

A daemon hit in bench.serve's QA workload loads a conversation's prefix (``--prefix`` tokens) and
then prefills the new turn (``--rest`` tokens) over it. Overlapping the two layer by layer can
save at most what running them at the same time saves: ``load + forward - both``, where ``both``
is the wall time of the load (on a worker thread, as the connector runs it) while the forward
pass runs on the engine thread over other pages. That is the bound measured here, per tier, as a
median of ``--reps`` interleaved runs; the saving is reported against the TTFT it would shorten
(``load + forward``). On a CPU machine both sides need the same cores, so ``both`` comes out
close to the sum. (Our blocks hold every layer of a page, so a real overlap would also need
per-layer reads from the daemon; the bound assumes they were free.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import torch

from bench.e2e.support import Bench, kv_daemon, machine_facts, offload_prefix
from bench.servers import prepare_bucket, seaweedfs_s3
from engine.forward_batch import ForwardBatch
from engine.model_loader import load_model


def _forward(eng, ids: list[int], ctx: int, pages: list[int]) -> float:
    batch = ForwardBatch.build([(ids, ctx, pages)], eng.pool.page_size, eng.device, logits="last")
    t0 = time.perf_counter()
    with torch.inference_mode():
        eng.model.forward(batch, eng.pool, eng.attn)
    return time.perf_counter() - t0


def measure(b: Bench, address: str, prefix: int, rest: int, reps: int) -> dict:
    eng = b.engine(num_pages=-(-(2 * prefix + rest) // 16) + 8)
    ids = b.text(prefix)
    b.attach(eng, address, load_mode="always")
    try:
        from engine.sampling import SamplingParams

        eng.generate([ids + [5]], SamplingParams(max_tokens=1, ignore_eos=True))  # its prefix into the radix
    finally:
        b.detach(eng)
    offload_prefix(b, eng, [address], ids, salt=None)  # type: ignore[arg-type]
    conn = b.attach(eng, address, load_mode="always")
    try:
        keys = conn.keyspace.keys(ids, None)
        n = len(keys)
        load_pages = eng.scheduler.cache.alloc(n)
        fwd_pages = eng.scheduler.cache.alloc(-(-(prefix + rest) // 16))
        assert load_pages is not None and fwd_pages is not None
        new = b.text(rest)
        samples: dict[str, list[float]] = {"load": [], "forward": [], "both": []}
        for _ in range(reps):
            samples["load"].append(conn.loader.load(keys, load_pages, 60.0).seconds)
            samples["forward"].append(_forward(eng, new, prefix, fwd_pages))
            t0 = time.perf_counter()
            th = threading.Thread(target=conn.loader.load, args=(keys, load_pages, 60.0))
            th.start()
            _forward(eng, new, prefix, fwd_pages)
            th.join()
            samples["both"].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in samples.items()}
        saving = med["load"] + med["forward"] - med["both"]
        return {"pages": n, "bytes": n * eng.pool.bytes_per_page, **{f"{k}_s": v for k, v in med.items()},
                "max_saving_s": saving, "max_saving_of_ttft": saving / (med["load"] + med["forward"])}
    finally:
        b.detach(eng)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve_overlap", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefix", type=int, default=640)
    ap.add_argument("--rest", type=int, default=48)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    machine = machine_facts()
    b = Bench(load_model(""), a.threads)
    b.rng = np.random.default_rng(5)
    out: dict = {"prefix_tokens": a.prefix, "rest_tokens": a.rest, "reps": a.reps, "tiers": {}}
    with tempfile.TemporaryDirectory(prefix="tierkv-overlap-") as work, seaweedfs_s3() as ep:
        bucket = f"tierkv-overlap-{uuid.uuid4().hex[:8]}"
        prepare_bucket(ep, bucket)
        s3_env = {"AWS_ACCESS_KEY_ID": ep.access_key, "AWS_SECRET_ACCESS_KEY": ep.secret_key,
                  "AWS_DEFAULT_REGION": ep.region}
        for tier, flags, env in (("cpu", ["--cpu", "2GiB"], None), ("disk", ["--disk", f"{work}/disk/lmdb:4GiB"], None),
                                 ("s3", ["--s3", f"s3://{bucket}/kv", "--s3-endpoint", ep.url], s3_env)):
            with kv_daemon(Path(work) / tier, *flags, env=env) as address:
                out["tiers"][tier] = measure(b, address, a.prefix, a.rest, a.reps)
    machine["loadavg_end"] = list(os.getloadavg())
    out["machine"] = machine
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
