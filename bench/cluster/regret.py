"""Does the cost model learn the network? Its load-or-recompute decisions per link to the shared
tier, judged on measured TTFTs (issue #25 item 4): ``measure_regret(h, RegretPlan())``.

Node A (``writer``) runs a kvengine replica on its daemon whose connector writes through: it
prefills every prompt of the run once (its greedy answers are the fresh-prefill answers every
read is checked against), and its daemon, stopped politely, writes every page through to the
shared tiers. Then, per link condition of node B (``reader``) to S3:

- ``none``: the bridge as it is;
- ``tbf_100mbit``: tbf on node B's veth, both ends (bench/cluster/topology.py ``set_rate``);
- ``rtt_20ms``: bench/slow_link.py's proxy in node B's namespace in front of S3, half the round trip
  each way (this kernel has no netem).

S3 is the shared tier in every case, so the links compare like with like: Redis Cluster cannot sit
behind the proxy (its MOVED redirects name the servers' own addresses, which bypass it). Node B's
daemon is restarted once for the measurement, cpu -> S3 only, its S3 reached through that proxy
(at zero delay but for ``rtt_20ms``): every measured page is one A wrote and B's daemon has not
held, fetched across the link. Beside it run three kvengine replicas (bench/cluster/node_engine.py)
differing only in ``TIERKV_CONNECTOR_LOAD_MODE``: ``always`` (forced to load; its load deadline
lifted so that a slow link's load is timed whole), ``never`` (forced to recompute) and ``auto``
(the cost model decides). They serve every link in turn, as a running engine sees its network
change; none is told the link: each has only its start-up probe (of B's daemon) and its own
loads, and serves ``learn`` prompts of the longest length, unmeasured, after each change before
the measured ones. The auto engine starts alone, after the writer is done (its start-up prefill
calibration shares the machine with no other engine's start or work).

Measured: for each prefix length (``lengths``, in pages; the prompt adds a ``question`` of a few
tokens) and repeat, each engine gets a prompt of its own, never seen by it nor by B's daemon, and
its TTFT (send to first streamed token) is timed; the auto engine's decision is read from the
answer's page outcomes (``loaded``/``read_failed``: it chose to load; ``bypassed``: to recompute).
A read whose greedy text differs from the writer's is a ``wrong_output``; a forced load that did
not load every page, or a forced recompute that loaded one, stops the bench (RegretError).

Figures per link (``link_figures``; pure, tests/bench/cluster/test_regret.py): per length,
``load_ttft_s`` and ``recompute_ttft_s`` (medians of the forced engines' runs), ``auto_ttft_s`` (the
auto engine's own median, for reference), ``load_share`` (its share of load decisions) and
``regret``: the mean over its decisions of (t_chosen - best) / best, t_chosen being the measured
time of the option it chose (bench/e2e/figures.py ``grid_verdict``, as bench.e2e.boundary judges
its cases). The link's ``regret`` is the mean over lengths; ``regret_time_weighted`` is
Σ(chosen − best) / Σ best over every decision (figures ``regret``); ``accuracy`` the share of
decisions that picked the faster option. ``regret_by_link`` = {link: regret}.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np

from bench.cluster.harness import ClusterHarness
from bench.cluster.node_engine import Completion, NodeEngine
from bench.e2e import figures as fig
from bench.slow_link import SlowLink

LINKS = ("none", "tbf_100mbit", "rtt_20ms")
MODES = ("auto", "always", "never")  # the auto engine first: it starts alone
PAGE_TOKENS = 16  # kvengine's default page size


class RegretError(RuntimeError):
    """A forced engine did not do what it was forced to (the measurement would be of something else)."""


@dataclass(frozen=True)
class RegretPlan:
    lengths: tuple[int, ...] = (1, 2, 4, 8, 16)  # prefix pages
    reps: int = 3
    learn: int = 2  # unmeasured prompts of the longest length each engine serves first
    links: tuple[str, ...] = LINKS
    writer: int = 0
    reader: int = 1
    rate_mbit: float = 100.0
    rtt_ms: float = 20.0
    question: int = 8  # tokens after the prefix
    max_tokens: int = 4  # greedy tokens compared with the writer's
    threads: int = 2
    reader_cpu: str = "512MiB"  # node B's daemon's cpu tier (its engines' probes land there)

    def __post_init__(self) -> None:
        if not self.lengths or min(self.lengths) < 1:
            raise ValueError(f"lengths: prefix pages >= 1, got {self.lengths}")
        if self.reps < 1 or self.learn < 0 or self.max_tokens < 1 or self.threads < 1:
            raise ValueError("reps, max_tokens and threads must be >= 1, learn >= 0")
        if not 0 < self.question < PAGE_TOKENS:
            raise ValueError(f"question: 1..{PAGE_TOKENS - 1} tokens (the prompt's last page), got {self.question}")
        if unknown := set(self.links) - set(LINKS):
            raise ValueError(f"unknown links {sorted(unknown)}; choose from {LINKS}")
        if self.writer == self.reader or min(self.writer, self.reader) < 0:
            raise ValueError("writer and reader are two different nodes")
        if self.rate_mbit <= 0 or self.rtt_ms <= 0:
            raise ValueError("rate_mbit and rtt_ms must be > 0")


# -- figures (pure) --------------------------------------------------------------------------------


class Case(NamedTuple):
    """One prefix length on one link: every run's TTFT per engine and the auto engine's decisions."""

    pages: int
    load_s: Sequence[float]
    recompute_s: Sequence[float]
    auto_s: Sequence[float]
    picked_load: Sequence[bool]


def _verdicts(c: Case) -> list[fig.Verdict]:
    if not (c.load_s and c.recompute_s and c.picked_load):
        raise fig.FigureError(f"{c.pages} pages: no runs")
    t_load, t_rec = statistics.median(c.load_s), statistics.median(c.recompute_s)
    return [fig.grid_verdict(p, t_load, t_rec) for p in c.picked_load]


def length_figures(c: Case) -> dict[str, object]:
    vs = _verdicts(c)
    return {"pages": c.pages, "load_ttft_s": statistics.median(c.load_s),
            "recompute_ttft_s": statistics.median(c.recompute_s),
            "auto_ttft_s": statistics.median(c.auto_s) if c.auto_s else None,
            "best": "load" if vs[0].best_is_load else "recompute",
            "load_share": sum(c.picked_load) / len(c.picked_load),
            "regret": statistics.fmean((v.chosen_s - v.best_s) / v.best_s for v in vs),
            "correct": sum(v.correct for v in vs) / len(vs)}


def link_figures(cases: Sequence[Case]) -> dict[str, object]:
    """The module doc's figures of one link over its prefix lengths."""
    if not cases:
        raise fig.FigureError("regret: no prefix lengths")
    per = [length_figures(c) for c in cases]
    verdicts = [v for c in cases for v in _verdicts(c)]
    return {"regret": statistics.fmean(p["regret"] for p in per),  # type: ignore[misc]
            "regret_time_weighted": fig.regret(verdicts),
            "accuracy": sum(v.correct for v in verdicts) / len(verdicts),
            "load_share_by_pages": {str(p["pages"]): p["load_share"] for p in per},
            "by_pages": per}


# -- the measurement -------------------------------------------------------------------------------


def _prompts(plan: RegretPlan, seed: int) -> dict[tuple[str, object, int, str], list[int]]:
    """A prompt of its own per (link, pages or "learn", repeat, engine mode)."""
    rng = np.random.default_rng(seed)
    keys: list[tuple[object, int]] = [("learn", i) for i in range(plan.learn)]
    keys += [(n, r) for r in range(plan.reps) for n in plan.lengths]
    out = {}
    for link in plan.links:
        for what, r in keys:
            pages = max(plan.lengths) if what == "learn" else int(what)  # type: ignore[call-overload]
            for mode in MODES:
                out[(link, what, r, mode)] = [int(x) for x in
                                              rng.integers(200, 40000, pages * PAGE_TOKENS + plan.question)]
    return out


def _engine_flags(plan: RegretPlan, pages: int) -> list[str]:
    return ["--no-blend", "--num-pages", str(pages), "--threads", str(plan.threads), "--max-num-seqs", "4",
            "--max-prefill-tokens", "8192"]  # one prefill step per prompt, as bench.e2e.boundary's engines


def _pool_pages(plan: RegretPlan) -> int:
    """Pages for every prompt one reader engine serves: nothing is evicted (and offloaded) while measuring."""
    per_link = plan.learn * (max(plan.lengths) + 1) + plan.reps * sum(n + 1 for n in plan.lengths)
    return len(plan.links) * per_link + 32


def _write(w: NodeEngine, h: ClusterHarness, plan: RegretPlan, prompts: dict, salt: str) -> dict:
    """Node A's engine prefills every prompt (its answers are the reference), then stops (its staged
    offloads reach its daemon); its daemon, stopped politely, writes every page through to the shared
    tiers before it exits, and a fresh one takes its place."""
    answers = {k: w.complete(ids, plan.max_tokens, salt).text for k, ids in prompts.items()}
    w.stop()
    h.stop_node(plan.writer)
    h.start_node(plan.writer)
    return answers


def _reader_env(mode: str, threads: int) -> dict[str, str]:
    env = {"TIERKV_CONNECTOR_LOAD_MODE": mode, "TIERKV_CONNECTOR_WRITE_THROUGH": "0",
           "OMP_NUM_THREADS": str(threads)}
    if mode == "always":  # a slow link's whole load is what is timed, not a deadline's cut
        env["TIERKV_CONNECTOR_LOAD_DEADLINE_MIN_S"] = "600"
    return env


def _checked(mode: str, pages: int, c: Completion) -> bool:
    """Whether the engine loaded (any page it chose to load); RegretError if a forced one did otherwise."""
    loaded, failed = c.outcome_pages("loaded"), c.outcome_pages("read_failed")
    if mode == "always" and loaded != pages:
        raise RegretError(f"a forced load loaded {loaded} of {pages} pages: {c.tierkv}")
    if mode == "always" and c.outcome_tiers("loaded") != {"s3"}:
        raise RegretError(f"a forced load was served by {c.outcome_tiers('loaded')}, not S3 alone: {c.tierkv}")
    if mode == "never" and loaded + failed:
        raise RegretError(f"a forced recompute loaded {loaded + failed} pages: {c.tierkv}")
    return loaded + failed > 0


class _Reader:
    """Node B's daemon (cpu -> S3 through the link's proxy) and its three engines, for every link."""

    def __init__(self, h: ClusterHarness, plan: RegretPlan, engines: dict[str, NodeEngine], proxy: SlowLink,
                 prompts: dict, answers: dict, salt: str) -> None:
        self.h, self.plan, self.engines, self.proxy = h, plan, engines, proxy
        self.prompts, self.answers, self.salt = prompts, answers, salt
        self.wrong = 0

    def read(self, key: tuple[str, object, int, str], pages: int) -> tuple[float, bool]:
        mode = key[3]
        c = self.engines[mode].complete(self.prompts[key], self.plan.max_tokens, self.salt)
        self.wrong += c.text != self.answers[key]
        return c.ttft_s, _checked(mode, pages, c)

    @contextlib.contextmanager
    def shaped(self, link: str) -> Iterator[None]:
        node = self.h.nodes[self.plan.reader]
        if link == "tbf_100mbit":
            self.h.topo.set_rate(node, self.plan.rate_mbit)
        elif link == "rtt_20ms":
            self.proxy.set_delay(self.plan.rtt_ms / 2000)
        try:
            yield
        finally:
            self.h.topo.clear_rate(node)
            self.proxy.set_delay(0.0)

    def link(self, link: str) -> dict[str, object]:
        plan, t0, wrong0 = self.plan, time.monotonic(), self.wrong
        with self.shaped(link):
            learn_loaded = {m: [self.read((link, "learn", i, m), max(plan.lengths))[1] for i in range(plan.learn)]
                            for m in MODES}
            runs: dict[int, dict[str, list]] = {n: {"always": [], "never": [], "auto": [], "picked": []}
                                                for n in plan.lengths}
            for r in range(plan.reps):
                order = plan.lengths if r % 2 == 0 else tuple(reversed(plan.lengths))
                for j, n in enumerate(order):
                    for mode in MODES[j % 3:] + MODES[: j % 3]:  # each engine first in turn
                        t, loaded = self.read((link, n, r, mode), n)
                        runs[n][mode].append(t)
                        if mode == "auto":
                            runs[n]["picked"].append(loaded)
        cases = [Case(n, runs[n]["always"], runs[n]["never"], runs[n]["auto"], runs[n]["picked"])
                 for n in plan.lengths]
        out = link_figures(cases)
        for p, n in zip(out["by_pages"], plan.lengths, strict=True):  # type: ignore[call-overload]
            p["runs"] = {"load_s": runs[n]["always"], "recompute_s": runs[n]["never"], "auto_s": runs[n]["auto"],
                         "auto_loaded": runs[n]["picked"]}
        out.update(wrong_outputs=self.wrong - wrong0, reads=len(MODES) * (plan.learn + plan.reps * len(plan.lengths)),
                   learn_loaded=learn_loaded, wall_s=round(time.monotonic() - t0, 1))
        return out


def measure_regret(h: ClusterHarness, plan: RegretPlan = RegretPlan(), seed: int = 2025) -> dict[str, object]:
    """``regret_by_link``, ``decisions_by_link`` ({link: {pages: load share}}) and ``regret`` (every
    link's figures, the plan, the answers checked)."""
    if max(plan.writer, plan.reader) >= len(h.nodes):
        raise ValueError(f"plan's nodes {plan.writer}, {plan.reader}: the cluster has {len(h.nodes)}")
    work = h.workdir / f"regret-{uuid.uuid4().hex[:6]}"
    salt = "regret-" + uuid.uuid4().hex[:8]
    prompts = _prompts(plan, seed)
    r_i, node = plan.reader, h.nodes[plan.reader]
    t0 = time.monotonic()
    host, _, port = h.s3.endpoint.url.removeprefix("http://").rpartition(":")
    with contextlib.ExitStack() as stack:
        proxy = stack.enter_context(SlowLink((host, int(port)), netns=h.topo.ns(node)))
        h.stop_node(r_i)
        h.start_node(r_i, cpu=plan.reader_cpu, redis=False, s3_url=f"http://{proxy.address}")

        @stack.callback
        def restore() -> None:  # before the proxy goes: the daemon's last write-through crosses it
            h.stop_node(r_i)
            h.start_node(r_i)

        def engine(i: int, mode: str, env: dict[str, str], pages: int) -> NodeEngine:
            return stack.enter_context(NodeEngine(h.topo, h.nodes[i], work, h.daemons[i].address,  # type: ignore[union-attr]
                                                  *_engine_flags(plan, pages), env=env, label=mode))

        # One engine starting at a time: each times its prefills at start-up (connector/calibrate.py),
        # and three started together on 2 cores took 44-46 s each to do it instead of 5 s, fitting a
        # fixed cost of 0.94-1.09 s instead of 0.13 s (their threads oversubscribe the cores).
        writer = engine(plan.writer, "writer", {"TIERKV_CONNECTOR_WRITE_THROUGH": "1",
                                                "OMP_NUM_THREADS": str(plan.threads)}, 256).wait_ready()
        engines = {m: engine(r_i, m, _reader_env(m, plan.threads), _pool_pages(plan)).wait_ready()
                   for m in ("always", "never")}
        answers = _write(writer, h, plan, prompts, salt)
        write_s = time.monotonic() - t0
        # alone as well: no other engine's start or work beside its calibration
        engines["auto"] = engine(r_i, "auto", _reader_env("auto", plan.threads), _pool_pages(plan)).wait_ready()
        ready_s = time.monotonic() - t0
        reader = _Reader(h, plan, engines, proxy, prompts, answers, salt)
        links = {link: reader.link(link) for link in plan.links}
    return {"regret_by_link": {k: v["regret"] for k, v in links.items()},
            "decisions_by_link": {k: v["load_share_by_pages"] for k, v in links.items()},
            "regret": {"plan": asdict(plan), "shared_tier": "s3", "writer_s": round(write_s, 1),
                       "engines_ready_s": round(ready_s, 1), "wall_s": round(time.monotonic() - t0, 1),
                       "wrong_outputs": sum(v["wrong_outputs"] for v in links.values()),  # type: ignore[misc]
                       "told_speed": False, "links": links}}
