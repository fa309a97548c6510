"""The linear layers of a step of a few rows, on the CPU: the fastest of three forms of ``x @ W^T``.

- ``F.linear``: torch's own. With torch's CPU build on this machine (2.13, 2 cores) it takes, on a
  few rows, a path that streams the weights on one thread whatever the thread count, and slower
  still at 2-3 rows: SmolLM2-135M's linear layers and LM head took 46 ms on one row with 1 or 2
  threads and 86-106 ms on 2-3 rows.
- the mm form, ``mm(W, x^T)^T`` (one row padded to two: its one-column path is as slow as
  ``F.linear``'s): 32 ms / 25 ms (1 / 2 threads) on one row and 25-46 ms on 2-3 rows, but 39-42 ms
  at 6-8 rows and 62-75 ms at 12-16 (2 threads).
- the native form (engine/native_gemm.py, csrc/gemm.c): streams each block of weight rows once
  against up to 6 rows of x held in registers, so a step costs about what one row costs until
  the arithmetic catches up with memory: 20-26 ms from 1 to 8 rows, 28-32 ms at 12-16, 57 ms at
  32 (F.linear 94), 2 threads. A decode step of one stream joined by another client's 5-token
  prompt is a 6-row step.

Prefill chunks are hundreds of rows, where F.linear is the form. Which form a step of n rows
takes is timed at start-up on the model's own weights at ``TIMED_ROWS`` (1, 2, 4, ... 32 rows):
at each, the fastest form, if it takes at most ``MARGIN`` of F.linear's time; from the first row
count where none does, F.linear (another CPU or build may not have the slow paths, and then
nothing changes). A step of n rows takes the form chosen at the first timed count >= n.

The choice is made once per process, so it must not be made on cores other processes were using:
under contention the two-thread forms wait for each other and F.linear's one thread does not, and
two of three engines started together on 2 cores chose F.linear for life where a lone one chooses
the mm form. So a timing whose cores were shared (engine/core_load.py) is taken again once they
are quiet, within ``QUIET_WAIT_S``; past it the last timing stands.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from engine import native_gemm
from engine.core_load import QUIET_WAIT_S, CoreLoad, QuietCores

log = logging.getLogger(__name__)

SMALL_ROWS = 32  # the most rows a form other than F.linear is used for
TIMED_ROWS = (1, 2, 4, 8, 16, SMALL_ROWS)  # the row counts timed at start-up, in order
MM_ROWS = 8  # the mm form is timed up to here (past it, it never beat F.linear)
MARGIN = 0.9  # the chosen form must take at most this share of F.linear's time
TIMINGS = 10  # the most timings of the choice: the first, then again after each wait for quiet cores

Linear = Callable[..., torch.Tensor]  # (x, w, b=None, rows=None) -> x @ w^T (+ b)
Form = Callable[..., torch.Tensor]  # (x, w, b=None) -> x @ w^T (+ b)
Plan = tuple[tuple[int, str], ...]  # (up to this many rows, form name), ascending; past the last: F.linear


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


def forms(threads: int, native: bool = True) -> dict[str, Form]:
    """The forms other than F.linear at ``threads`` threads: the mm form, and the native one where
    its library loads (engine/native_gemm.py) unless ``native`` is False."""
    out: dict[str, Form] = {"mm": mm_form}
    lin = native_gemm.linear(threads) if native else None
    if lin is not None:
        out["native"] = lin
    return out


class SmallRows:
    """A step of n rows, ``0 < n <= `` the plan's last bound, takes the form of the first plan entry
    whose bound is >= n; other steps take ``F.linear``. ``rows``: the row count that decides
    (default: x's), so a subset of a batch's rows is computed as the whole batch would have been
    (engine/model.py's last layer, on the rows that need logits)."""

    __slots__ = ("plan", "_steps", "upto")

    def __init__(self, plan: Plan, forms: dict[str, Form]) -> None:
        self.plan = plan
        self._steps = tuple((n, forms[name]) for n, name in plan)
        self.upto = plan[-1][0] if plan else 0

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                 rows: int | None = None) -> torch.Tensor:  # fmt: skip
        n = x.shape[0] if rows is None else rows
        if 0 < n <= self.upto:
            for bound, form in self._steps:
                if n <= bound:
                    return form(x, w, b)
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


def small_rows_plan(weights: Sequence[torch.Tensor], candidates: dict[str, Form], reps: int = 2) -> Plan:
    """At each of ``TIMED_ROWS``, the fastest of ``candidates`` over ``weights`` (the model's own,
    [out, in] each, so the timing streams them as a step does) if it took at most ``MARGIN`` of
    F.linear's time; up to the first row count where none did. Adjacent counts with the same form
    are one entry."""
    if not weights or weights[0].device.type != "cpu":
        return ()
    dtype = weights[0].dtype
    plan: list[tuple[int, str]] = []
    for n in TIMED_ROWS:
        xs = {k: torch.randn(n, k, dtype=dtype) for k in {w.shape[1] for w in weights}}
        t_linear = _time(F.linear, xs, weights, reps)
        timed = {name: _time(fn, xs, weights, reps) for name, fn in candidates.items()
                 if name != "mm" or n <= MM_ROWS}
        log.debug("linear layers at %d rows: F.linear %.1f ms, %s", n, 1e3 * t_linear,
                  ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in timed.items()))
        best = min(timed, key=timed.__getitem__, default=None)
        if best is None or timed[best] > MARGIN * t_linear:
            break
        if plan and plan[-1][1] == best:
            plan[-1] = (n, best)
        else:
            plan.append((n, best))
    return tuple(plan)


def chosen_plan(weights: Sequence[torch.Tensor], candidates: dict[str, Form], quiet: QuietCores) -> Plan:
    """``small_rows_plan``, timed again once the cores are quiet where they were shared (module doc)."""
    plan, calm = quiet.timed(lambda: small_rows_plan(weights, candidates))
    for _ in range(TIMINGS - 1):
        if calm or not quiet.wait():
            break
        plan, calm = quiet.timed(lambda: small_rows_plan(weights, candidates))
    return plan


def describe(plan: Plan) -> str:
    if not plan:
        return "F.linear"
    parts, lo = [], 1
    for n, name in plan:
        parts.append(f"{'native' if name == 'native' else 'mm form'} for {lo}-{n} rows" if lo < n else
                     f"{'native' if name == 'native' else 'mm form'} for {n} row{'s' if n > 1 else ''}")
        lo = n + 1
    return ", ".join(parts) + f", F.linear past {plan[-1][0]}"


_CHOSEN: dict[tuple[object, ...], Plan] = {}  # per model, dtype and thread count: timed once per process


def for_weights(key: object, weights: Sequence[torch.Tensor], load: CoreLoad | None | str = "auto",
                quiet_wait_s: float = QUIET_WAIT_S, native: bool = True) -> Linear:
    """The linear of a model (``key`` names its weights) on the CPU at the current thread count.
    ``load``: how busy the cores are ("auto": this process's, from /proc; None: never wait);
    ``quiet_wait_s``: the most it waits for them (the engine's ``cpu_gemm_quiet_wait_s``; 0: never);
    ``native``: offer the native form (the engine's ``cpu_gemm`` "auto"; "torch": not)."""
    threads = torch.get_num_threads()
    candidates = forms(threads, native)
    k = (key, weights[0].dtype if weights else None, threads, tuple(candidates))
    if k not in _CHOSEN:
        if isinstance(load, str):
            load = CoreLoad.for_timing(weights[0].device.type, quiet_wait_s) if weights else None
        quiet = QuietCores(load, quiet_wait_s, threads)
        _CHOSEN[k] = chosen_plan(weights, candidates, quiet)
        why = native_gemm.load()[1] if native else ""
        log.info("linear layers: %s (%.1fs waiting for quiet cores, %d timings on shared cores%s)",
                 describe(_CHOSEN[k]), quiet.waited_s, quiet.contended, f"; no native form: {why}" if why else "")
    plan = _CHOSEN[k]
    return SmallRows(plan, candidates) if plan else plain
