"""Start-up measurements on this machine: a prefill model and a probe of the daemon.

Both run through the real code paths (the engine's forward pass over scratch pool pages; the
loader writing daemon blocks into scratch pages), so what they measure is what a request pays.
The daemon probe lives in connector/probe.py (distinct blocks beyond the last-level cache, one
thread policy, a line fitted over several batch sizes); ``probe_daemon`` is re-exported here.

The prefill timings want the cores to themselves (connector/core_load.py: engines started together
time their prefills against each other). So the calibration first waits, a jittered pause at a
time, for the other processes to leave enough of this process's cores free for its threads
(``THREAD_SLACK``), and a
timed shape none of whose runs had the cores that quiet is timed again after another such wait.
All the waiting together is bounded by ``QUIET_WAIT_S``; past it the calibration takes what it
has (each shape's fastest run, as always: other processes only ever add time), logs a warning and
counts the contended runs in the fit's log line. The online correction then does the rest.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable

import numpy as np
import torch

from connector.config import CALIBRATION_ENV
from connector.core_load import CoreLoad
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


#: a timed prefill is trusted when the cores other processes leave free number at least the
#: engine's threads less this (and at most 3/4 of its cores are asked for): with 2 threads on
#: 2 cores, others may take a quarter of them; with 1 thread there, one whole core is its own; with
#: 2 threads on a 64-core node, a busy node is still quiet enough
THREAD_SLACK = 0.5
#: the most one calibration waits, all its waits together, for its cores to be quiet (the
#: connector's ``calibrate_quiet_wait_s``): past it, cores kept busy are the engine's lot, and
#: what it times there is what its requests will pay
QUIET_WAIT_S = 20.0
#: how long one look at the cores lasts, and the jittered pause after a busy one (engines started
#: together then do not all look again at the same moment)
LOOK_S = 0.15
PAUSE_S = (0.25, 1.0)
#: a quiet look is confirmed by a second one after a random pause of up to this: two engines
#: waiting for each other both see quiet cores (each is only looking) and would start together;
#: the second look of the later one sees the earlier one's prefills. Without it, two of three
#: engines started at once timed 14 runs each on shared cores (bench.calibrate_together).
CONFIRM_PAUSE_S = 0.3
#: extra runs of a shape none of whose runs had quiet cores
RETRIES = 2


class _Quiet:
    """The calibration's waits for quiet cores, within one budget."""

    def __init__(self, load: CoreLoad | None, budget_s: float, sleep: Callable[[float], None],
                 rng: random.Random, threads: int) -> None:
        self.load, self.left, self.sleep, self.rng = load, budget_s, sleep, rng
        self.waited_s = 0.0
        self.contended = 0  # timed runs that shared their cores
        cores = len(load.cpus) if load is not None else 1
        self.need = min(max(threads - THREAD_SLACK, THREAD_SLACK), 0.75 * cores)  # free cores wanted

    def _quiet(self, share: float | None) -> bool:
        return share is None or (1.0 - share) * len(self.load.cpus) >= self.need  # type: ignore[union-attr]

    def wait(self) -> bool:
        """Until the cores are quiet (True) or the budget is spent (False)."""
        if self.load is None:
            return True
        quiet_looks = 0
        while True:
            self.load.mark()
            self.sleep(LOOK_S)
            share = self.load.others_share()
            self._spend(LOOK_S)
            if self._quiet(share):
                quiet_looks += 1
                if quiet_looks == 2:
                    return True
                pause = self.rng.uniform(0.0, CONFIRM_PAUSE_S)
            else:
                quiet_looks = 0
                if self.left <= 0:
                    return False
                pause = self.rng.uniform(*PAUSE_S)
            self._spend(pause)
            self.sleep(pause)

    def _spend(self, s: float) -> None:
        self.left -= s
        self.waited_s += s

    def timed(self, fn: Callable[[], float | None]) -> tuple[float | None, bool]:
        """(``fn``'s seconds, whether the cores were quiet meanwhile)."""
        if self.load is None:
            return fn(), True
        self.load.mark()
        t = fn()
        quiet = self._quiet(self.load.others_share())
        self.contended += not quiet
        return t, quiet


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
    if isinstance(load, str):  # "auto": a GPU's prefills do not run on the cores
        load = CoreLoad.open() if view.device.type == "cpu" and quiet_wait_s > 0 else None
    quiet = _Quiet(load, quiet_wait_s, sleep, random.Random(), torch.get_num_threads())
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
