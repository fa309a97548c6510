"""Start-up measurements on this machine: a prefill model and a probe of the daemon.

Both run through the real code paths (the engine's forward pass over scratch pool pages; the
loader writing daemon blocks into scratch pages), so what they measure is what a request pays.
The daemon probe lives in connector/probe.py (distinct blocks beyond the last-level cache, one
thread policy, a line fitted over several batch sizes); ``probe_daemon`` is re-exported here.
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
from connector.probe import ProbeResult, probe_daemon
from engine.forward_batch import ForwardBatch
from engine.hooks import EngineView

log = logging.getLogger(__name__)
__all__ = ["PREFILL_SAMPLES", "ProbeResult", "calibrate_prefill", "probe_daemon", "time_prefill"]

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
