"""Start-up measurements on this machine: a prefill model and a probe of the daemon.

Both run through the real code paths (the engine's forward pass over scratch pool pages; the
loader writing daemon blocks into scratch pages), so what they measure is what a request pays.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import numpy as np
import torch

from connector.config import CALIBRATION_ENV
from connector.cost_model import PrefillModel
from connector.dtypes import to_block_array
from connector.loader import Loader
from connector.offload import LAYOUT
from engine.forward_batch import ForwardBatch
from engine.hooks import EngineView
from kvstore.block import encode_block
from kvstore.client.client import KVStoreClient
from kvstore.keys import key_prefix

log = logging.getLogger(__name__)

#: (new tokens, cached context) of the timed prefills
PREFILL_SAMPLES = ((16, 0), (64, 0), (256, 0), (384, 0), (128, 512), (128, 1024))
_PREFILL_CACHE: dict[tuple, PrefillModel] = {}


def _with_scratch(view: EngineView, n_pages: int, fn: Callable[[list[int]], float]) -> float | None:
    pages = view.pages.alloc(n_pages)  # the PageSource hooks use
    if pages is None:
        return None
    try:
        return fn(pages)
    finally:
        view.pages.free(pages)


def time_prefill(view: EngineView, new: int, ctx: int) -> float | None:
    """Seconds of one forward pass feeding ``new`` tokens after ``ctx`` cached ones (garbage KV)."""
    ps = view.pool.page_size
    n_pages = -(-(new + ctx) // ps)
    ids = [int(x) for x in np.random.default_rng(new + ctx).integers(100, view.arch.vocab_size - 1, new)]

    def run(pages: list[int]) -> float:
        batch = ForwardBatch.build([(ids, ctx, pages)], ps, view.device, logits="last")
        t0 = time.perf_counter()
        with torch.inference_mode():
            view.forward(batch)
        if view.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    return _with_scratch(view, n_pages, run)


def calibrate_prefill(view: EngineView, samples=PREFILL_SAMPLES, cache: bool = True, repeats: int = 2) -> PrefillModel:
    """Fit a + b*new + c*new*ctx over a few timed prefills (cached per model/device/dtype/threads)."""
    key = (view.fingerprint, str(view.device), str(view.dtype), torch.get_num_threads(),
           os.environ.get(CALIBRATION_ENV, ""))
    if cache and key in _PREFILL_CACHE:
        return _PREFILL_CACHE[key]
    t0 = time.perf_counter()
    time_prefill(view, 16, 0)  # warm-up
    points = []
    for new, ctx in samples:
        runs = [t for t in (time_prefill(view, new, ctx) for _ in range(repeats)) if t is not None]
        if runs:
            points.append((new, ctx, min(runs)))  # the min: other processes only ever add time
    if len(points) < 3:
        raise RuntimeError("KV pool too small to calibrate the prefill model")
    model = PrefillModel.fit(points)
    log.info("prefill model a=%.4fs b=%.2fms/token c=%.3gs/token^2 from %d prefills in %.1fs", model.a,
             model.b * 1e3, model.c, len(points), time.perf_counter() - t0)
    if cache:
        _PREFILL_CACHE[key] = model
    return model


def probe_daemon(client: KVStoreClient, loader: Loader, view: EngineView, n_blocks: int = 16,
                 deadline_s: float = 5.0, tenant: str = "") -> tuple[str, float, float] | None:
    """Latency and bandwidth of a load from the daemon's first tier: (tier, latency s, bytes/s).
    ``tenant``: write the scratch blocks in that tenant's namespace (one the engine's credential
    lists; "" = untagged keys, which a tenant's credential may not write)."""
    pool = view.pool
    rng = np.random.default_rng()
    if tenant:
        keys = [key_prefix(tenant) + rng.bytes(16) for _ in range(n_blocks)]
    else:
        keys = [b"tierkv-probe-" + rng.bytes(8) for _ in range(n_blocks)]
    shape = pool.block_shape()
    block = torch.zeros(shape, dtype=pool.dtype)
    arr, dtype = to_block_array(block)
    client.deadline_s = deadline_s
    client.put_many([(k, encode_block(k, arr, dtype=dtype, shape=arr.shape, layout=LAYOUT)) for k in keys])
    try:
        found = loader.lookup_all(keys, deadline_s, in_place=True)  # loads then go as the connector's do
        tiers = found.tiers[: found.prefix_len]
        tier = tiers[0] if tiers and tiers[0] else "cpu"

        def timed(n: int) -> float:
            best = float("inf")
            for _ in range(3):
                t = _with_scratch(view, n, lambda pages: loader.load(keys[:n], pages, deadline_s,
                                                                       in_place=found.in_place).seconds)
                if t is None:
                    return float("nan")
                best = min(best, t)
            return best

        t1, tn = timed(1), timed(n_blocks)
        if not np.isfinite(t1) or not np.isfinite(tn):
            return None
        per_block = (tn - t1) / (n_blocks - 1)
        if per_block <= 0 or per_block > t1:  # noise swamped the difference: charge all to bandwidth
            per_block, lat = tn / n_blocks, 0.0
        else:
            lat = t1 - per_block
        bw = pool.bytes_per_page / per_block
        log.info("daemon probe: tier %s latency %.2f ms bandwidth %.2f GB/s", tier, lat * 1e3, bw / 1e9)
        return tier, lat, bw
    finally:
        try:
            client.delete(keys)
        except Exception:  # noqa: BLE001 - best effort
            pass
