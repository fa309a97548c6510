"""Start-up measurements on this machine: a prefill model and a probe of the daemon.

Both run through the real code paths (the engine's forward pass over scratch pool pages; the
loader writing daemon blocks into scratch pages), so what they measure is what a request pays.
The daemon probe lives in connector/probe.py (distinct blocks beyond the last-level cache, one
thread policy, a line fitted over several batch sizes); ``probe_daemon`` is re-exported here.

The prefill timings want the cores to themselves (engine/core_load.py: engines started together
time their prefills against each other). So the calibration first waits, a jittered pause at a
time, for the other processes to leave enough of this process's cores free for its threads
(``QuietCores``), and a
timed shape none of whose runs had the cores that quiet is timed again after another such wait.
All the waiting together is bounded by ``QUIET_WAIT_S``; past it the calibration takes what it
has (each shape's fastest run, as always: other processes only ever add time), logs a warning and
counts the contended runs in the fit's log line. The online correction then does the rest.
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
from engine.core_load import QUIET_WAIT_S, CoreLoad, QuietCores
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


#: extra runs of a shape none of whose runs had quiet cores
RETRIES = 2


def calibrate_prefill(view: EngineView, samples=PREFILL_SAMPLES, cache: bool = True, repeats: int = 2,
                      load: CoreLoad | None | str = "auto", quiet_wait_s: float = QUIET_WAIT_S,
                      sleep: Callable[[float], None] = time.sleep) -> PrefillModel:
    """Fit a + b*new + c*new*ctx over a few timed prefills (cached per model/device/dtype/threads),
    timed while the cores are quiet where that can be had (module doc). ``load``: how busy the cores
    are ("auto": this process's, from /proc; None: never wait)."""
    key = (view.fingerprint, str(view.device), str(view.dtype), torch.get_num_threads(),
           os.environ.get(CALIBRATION_ENV, ""))
    if cache and key in _PREFILL_CACHE:
        return _PREFILL_CACHE[key]
    t0 = time.perf_counter()
    if isinstance(load, str):
        load = CoreLoad.for_timing(view.device.type, quiet_wait_s)
    quiet = QuietCores(load, quiet_wait_s, torch.get_num_threads(), sleep)
    time_prefill(view, 16, 0)  # warm-up
    settled = quiet.wait()
    points = []
    for new, ctx in samples:
        runs: list[float] = []
        calm = False
        for attempt in range(repeats + RETRIES):
            if attempt >= repeats:
                if calm or not settled:
                    break
                settled = quiet.wait()  # a shape timed only on shared cores: again, once they are quiet
            t, ok = quiet.timed(lambda new=new, ctx=ctx: time_prefill(view, new, ctx))
            if t is None:
                break
            runs.append(t)
            calm |= ok
        if runs:
            points.append((new, ctx, min(runs)))  # the min: other processes only ever add time
    if len(points) < 3:
        raise RuntimeError("KV pool too small to calibrate the prefill model")
    model = PrefillModel.fit(points)
    log.info("prefill model a=%.4fs b=%.2fms/token c=%.3gs/token^2 from %d prefills in %.1fs (%.1fs of it "
             "waiting for quiet cores, %d timed runs on shared cores)", model.a, model.b * 1e3, model.c,
             len(points), time.perf_counter() - t0, quiet.waited_s, quiet.contended)
    if not settled:
        log.warning("prefill calibration: other processes kept this engine's cores busy for %.0fs; the prefill "
                    "model may be slow until the engine's own steps correct it", quiet_wait_s)
    if cache:
        _PREFILL_CACHE[key] = model
    return model
