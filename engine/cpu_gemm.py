"""The linear layers of a step of a few rows, on the CPU: ``mm(W, x^T)^T`` where it beats ``F.linear``.

Both are ``x @ W^T``. With torch's CPU build on this machine (2.13, 2 cores), ``F.linear`` on a few
rows takes a path that streams the weights on one thread whatever the thread count, and slower
still at 2-3 rows: SmolLM2-135M's linear layers and LM head took 46 ms on one row with 1 or 2
threads and 86-106 ms on 2-3 rows, against 32 ms / 25 ms (1 / 2 threads) on one row and 25-46 ms
on 2-3 rows for ``torch.mm`` with the weight as the left operand (one row padded to two: its
one-column path is as slow as ``F.linear``'s). A decode step of one stream went from ~55 ms to
~26-31 ms on 2 threads (``python -m bench.mixed_step``). From about 10 rows up the two trade places
by shape and thread count, and prefill chunks are hundreds of rows, so the ``mm`` form is used only
up to ``SMALL_ROWS`` rows, and only as far as the start-up timing on the model's own weights
(``small_rows_upto``, at 1, 2, 4 and 8 rows) finds it faster: on 1 thread here it is up to 4 rows
(at 8 the two are even); another CPU or build may not have the slow path, and then nothing changes.

The choice is made once per process, so it must not be made on cores other processes were using:
under contention the mm form's two threads wait for each other and F.linear's one does not, and two
of three engines started together on 2 cores chose F.linear for life where a lone one chooses the
mm form. So a timing whose cores were shared (engine/core_load.py) is taken again once they are
quiet, within ``QUIET_WAIT_S``; past it the last timing stands.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from engine.core_load import QUIET_WAIT_S, CoreLoad, QuietCores

log = logging.getLogger(__name__)

SMALL_ROWS = 8
TIMED_ROWS = (1, 2, 4, SMALL_ROWS)  # the row counts timed at start-up, in order
MARGIN = 0.9  # the mm form must take at most this share of F.linear's time at each of them
TIMINGS = 10  # the most timings of the choice: the first, then again after each wait for quiet cores

Linear = Callable[..., torch.Tensor]  # (x, w, b=None, rows=None) -> x @ w^T (+ b)


def plain(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, rows: int | None = None) -> torch.Tensor:
    """``F.linear``; ``rows`` is ignored (the signature of ``SmallRows``)."""
    return F.linear(x, w, b)


def mm_form(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w^T`` as ``mm(w, x^T)^T`` (one row padded to two), contiguous like ``F.linear``'s."""
    if x.shape[0] == 1:
        y = torch.mm(w, torch.cat([x, x]).t())[:, :1].t().contiguous()
    else:
        y = torch.mm(w, x.t()).t().contiguous()
    return y if b is None else y.add_(b)


class SmallRows:
    """``mm_form`` for a step of at most ``upto`` rows, ``F.linear`` otherwise. ``rows``: the row
    count that decides (default: x's), so a subset of a batch's rows is computed as the whole batch
    would have been (engine/model.py's last layer, on the rows that need logits)."""

    __slots__ = ("upto",)

    def __init__(self, upto: int) -> None:
        self.upto = upto

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                 rows: int | None = None) -> torch.Tensor:  # fmt: skip
        n = x.shape[0] if rows is None else rows
        if 0 < n <= self.upto:
            return mm_form(x, w, b)
        return F.linear(x, w, b)


def _time(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], xs: dict[int, torch.Tensor],
          weights: Sequence[torch.Tensor], reps: int) -> float:  # fmt: skip
    """Best of ``reps`` passes over every weight (one warm pass first)."""
    best = float("inf")
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        for w in weights:
            fn(xs[w.shape[1]], w)
        if rep:
            best = min(best, time.perf_counter() - t0)
    return best


def small_rows_upto(weights: Sequence[torch.Tensor], reps: int = 2) -> int:
    """The largest of ``TIMED_ROWS`` up to which the mm form took at most ``MARGIN`` of F.linear's
    time over ``weights`` (the model's own, [out, in] each, so the timing streams them as a step
    does) at every timed row count; 0 if not even at one row."""
    if not weights or weights[0].device.type != "cpu":
        return 0
    dtype = weights[0].dtype
    upto = 0
    for n in TIMED_ROWS:
        xs = {k: torch.randn(n, k, dtype=dtype) for k in {w.shape[1] for w in weights}}
        t_linear = _time(F.linear, xs, weights, reps)
        t_mm = _time(mm_form, xs, weights, reps)
        log.debug("linear layers at %d rows: F.linear %.1f ms, mm %.1f ms", n, 1e3 * t_linear, 1e3 * t_mm)
        if t_mm > MARGIN * t_linear:
            break
        upto = n
    return upto


def chosen_upto(weights: Sequence[torch.Tensor], quiet: QuietCores) -> int:
    """``small_rows_upto``, timed again once the cores are quiet where they were shared (module doc)."""
    upto, calm = quiet.timed(lambda: small_rows_upto(weights))
    for _ in range(TIMINGS - 1):
        if calm or not quiet.wait():
            break
        upto, calm = quiet.timed(lambda: small_rows_upto(weights))
    return upto


_CHOSEN: dict[tuple[object, ...], int] = {}  # per model, dtype and thread count: timed once per process


def for_weights(key: object, weights: Sequence[torch.Tensor], load: CoreLoad | None | str = "auto",
                quiet_wait_s: float = QUIET_WAIT_S) -> Linear:
    """The linear of a model (``key`` names its weights) on the CPU at the current thread count.
    ``load``: how busy the cores are ("auto": this process's, from /proc; None: never wait);
    ``quiet_wait_s``: the most it waits for them (the engine's ``cpu_gemm_quiet_wait_s``; 0: never)."""
    k = (key, weights[0].dtype if weights else None, torch.get_num_threads())
    if k not in _CHOSEN:
        if isinstance(load, str):
            load = CoreLoad.for_timing(weights[0].device.type, quiet_wait_s) if weights else None
        quiet = QuietCores(load, quiet_wait_s, torch.get_num_threads())
        _CHOSEN[k] = chosen_upto(weights, quiet)
        log.info("linear layers: %s (%.1fs waiting for quiet cores, %d timings on shared cores)",
                 f"mm form up to {_CHOSEN[k]} rows" if _CHOSEN[k] else "F.linear", quiet.waited_s, quiet.contended)
    upto = _CHOSEN[k]
    return SmallRows(upto) if upto else plain
