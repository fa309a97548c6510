"""The soak's figures, as pure functions of what it recorded (tests: tests/bench/soak/test_figures.py).

Growth is measured per process identity (bench/soak/watch.py), after warm-up: from the median of
the first fifth of an identity's samples past ``max(warm mark, its own start + warm_s)`` to the
median of the last fifth (at least ``window`` = 3 samples each) — a restarted daemon is compared
with itself, never with the process it replaced; a spike, or the allocator's ±10 MB swings, at
either end does not count, while a steady leak shows at four fifths of its size. An identity
with too few samples past its warm-up is listed as not measured (never as zero growth).

The headline ``rss_growth_mb`` is the largest growth of *anonymous* RSS (the heap, where a leak
lives) over every identity; total RSS, file-backed RSS (the disk tier's lmdb map: page cache,
bounded by the file) and shared-memory RSS are reported beside it.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

from bench.soak.watch import Sample

MIB = 1024**2


class Growth(NamedTuple):
    identity: str
    role: str
    t_from: float
    t_to: float
    samples: int
    start: float
    end: float

    @property
    def growth(self) -> float:
        return self.end - self.start


def growth(samples: Iterable[Sample], value: Callable[[Sample], float], warm_at: float, warm_s: float,
           window: int = 3, key: Callable[[Sample], str] = lambda s: s.identity) -> tuple[list[Growth], list[str]]:  # fmt: skip
    """(growth of each identity measured, identities too short to measure). ``key=lambda s: s.role``
    measures each role instead, across restarts: the mistake the naive figures show."""
    measured, short = [], []
    groups: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        groups[key(s)].append(s)
    for ident, ss in groups.items():
        ss = sorted(ss, key=lambda s: s.t)
        since = max(warm_at, ss[0].t + warm_s)
        after = [s for s in ss if s.t >= since]
        if len(after) < 2 * window:
            short.append(ident)
            continue
        k = max(window, len(after) // 5)
        head, tail = after[:k], after[-k:]
        measured.append(Growth(ident, ss[0].role, head[0].t, tail[-1].t, len(after),
                               statistics.median(value(s) for s in head), statistics.median(value(s) for s in tail)))  # fmt: skip
    return measured, short


def shm_rounds(samples: Iterable[Sample]) -> list[tuple[float, int]]:
    """(time, bytes of client segments mapped by any watched process, each segment once) per sampling round."""
    rounds: dict[float, dict[int, int]] = defaultdict(dict)
    for s in samples:
        merged = rounds[s.t]
        for inode, n in s.shm.items():
            merged[inode] = max(merged.get(inode, 0), n)
    return sorted((t, sum(m.values())) for t, m in rounds.items())


def series_growth(points: Sequence[tuple[float, float]], warm_at: float, window: int = 3) -> float | None:
    after = [v for t, v in points if t >= warm_at]
    if len(after) < 2 * window:
        return None
    k = max(window, len(after) // 5)
    return statistics.median(after[-k:]) - statistics.median(after[:k])


def memory_figures(samples: Sequence[Sample], warm_at: float, warm_s: float) -> dict[str, Any]:
    """rss_growth_mb, fd_growth, shm_growth_mb (the targets) and the per-identity detail behind them."""
    fields: dict[str, Callable[[Sample], float]] = {
        "rss_anon_mb": lambda s: s.anon / MIB, "rss_mb": lambda s: s.rss / MIB, "rss_file_mb": lambda s: s.file / MIB,
        "rss_shmem_mb": lambda s: s.shmem / MIB, "rss_lmdb_mb": lambda s: s.lmdb / MIB,
        "rss_anon_less_queued_mb": lambda s: (s.anon - s.queued) / MIB, "fds": lambda s: s.fds,
        "threads": lambda s: s.threads}  # fmt: skip
    detail: dict[str, dict[str, Any]] = defaultdict(dict)
    worst: dict[str, float | None] = {}
    short: list[str] = []
    for name, fn in fields.items():
        measured, short = growth(samples, fn, warm_at, warm_s)
        worst[name] = max((g.growth for g in measured), default=None)
        for g in measured:
            detail[g.identity].update(role=g.role, t_from=round(g.t_from, 1), t_to=round(g.t_to, 1), samples=g.samples)
            detail[g.identity][name] = [round(g.start, 2), round(g.end, 2)]
    shm = series_growth(shm_rounds(samples), warm_at)
    naive = {  # how the daemon's growth reads when measured wrongly (RELIABILITY.md, "Soak")
        "by_role_rss_mb": {g.identity: _r(g.growth) for g in growth(samples, fields["rss_mb"], warm_at, 0,
                                                                     key=lambda s: s.role)[0]},
        "by_role_fds": {g.identity: g.growth for g in growth(samples, fields["fds"], warm_at, 0,
                                                             key=lambda s: s.role)[0]},
        "from_birth_rss_mb": {g.identity: _r(g.growth) for g in growth(samples, fields["rss_mb"], 0, 0)[0]},
        "from_birth_anon_mb": {g.identity: _r(g.growth) for g in growth(samples, fields["rss_anon_mb"], 0, 0)[0]},
        "from_birth_fds": {g.identity: g.growth for g in growth(samples, fields["fds"], 0, 0)[0]},
    }
    return {"rss_growth_mb": _r(worst["rss_anon_mb"]), "fd_growth": worst["fds"], "shm_growth_mb": _r(shm / MIB if shm is not None else None),
            "threads_growth": worst["threads"], "rss_total_growth_mb": _r(worst["rss_mb"]),
            "rss_file_growth_mb": _r(worst["rss_file_mb"]), "rss_lmdb_growth_mb": _r(worst["rss_lmdb_mb"]),
            "rss_shmem_growth_mb": _r(worst["rss_shmem_mb"]),
            "rss_anon_less_queued_growth_mb": _r(worst["rss_anon_less_queued_mb"]),
            "growth_by_process": dict(detail), "not_measured": short, "naive": naive}  # fmt: skip


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 2)


class Checked(NamedTuple):
    requests: int
    client_errors: int
    wrong_outputs: int
    errors: list[str]  # the first few, for the report
    wrong: list[str]
    daemon_loaded: int = 0  # checked answers (no error) whose prefix had pages loaded from the daemon

    @property
    def daemon_loaded_share(self) -> float | None:
        """Of the answers checked against a reference, the share that used KV loaded from the daemon:
        how much of the wrong-output check covered the load path rather than the radix tree."""
        checked = self.requests - self.client_errors
        return round(self.daemon_loaded / checked, 3) if checked else None


def check_answers(answers: Iterable[Any], reference: dict[str, str]) -> Checked:
    """Every answer against the cold reference of its prompt: an error is a client error, other
    text a wrong output. An answer whose prompt has no reference is a client error too (it could
    not be checked)."""
    n = errors = wrong = loaded = 0
    err_list: list[str] = []
    wrong_list: list[str] = []
    for a in answers:
        n += 1
        if a.error is not None or a.pid not in reference:
            errors += 1
            err_list.append(f"{a.pid} {a.tenant} {a.replica}: {a.error or 'no reference'}")
        else:
            loaded += a.sources.get("daemon", 0) > 0
            if a.text != reference[a.pid]:
                wrong += 1
                wrong_list.append(f"{a.pid} {a.tenant} {a.replica} cached={a.cached} sources={a.sources}: "
                                  f"{a.text!r} != {reference[a.pid]!r}")
    return Checked(n, errors, wrong, err_list[:10], wrong_list[:10], loaded)


def cross_tenant_hits(probes: Iterable[Any]) -> int:
    """Probes (another tenant's first request for a prompt only its owner sent) that reported cached tokens."""
    return sum(1 for a in probes if a.error is None and a.cached > 0)


def during_outages(answers: Iterable[Any], faults: Iterable[dict[str, Any]], target: str = "daemon") -> int:
    """Answers whose request was in flight while ``target`` was down (killed, not yet back)."""
    windows = [(f["killed_at"], f.get("back_at", float("inf"))) for f in faults if f["target"] == target]
    return sum(1 for a in answers if any(a.t0 < back and a.t1 > killed for killed, back in windows))
