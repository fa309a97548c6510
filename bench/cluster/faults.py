"""The faults of issue #25, each injected while every node keeps writing and reading (bench/cluster/rounds.py).

Every fault runs the same way: ``inject``, ``during`` rounds with the fault in place (or until it
resolves itself), ``heal``, then rounds until the ``watched`` nodes each read another node's blocks
whole, with no client error and no wrong block, in one round (``Round.full_hit``). Then rounds go
on until a round is clean on every node, so the next fault starts from a working cluster.

- ``redis_master_killed``: a Redis master SIGKILLed; rounds go on until its replica is master
  (``promoted_s``); nothing heals it, so ``recovery_s`` counts from the kill. The daemons detach
  the Redis tier when its calls fail and read from S3 meanwhile, so rounds then go on until Redis
  answers every read again: ``redis_serving_again_s`` (from the kill). The killed node then
  rejoins as a replica, outside the measurement.
- ``node_partitioned``: the last node's link down for ``during`` rounds, then up; ``recovery_s``:
  link up to the end of its first round reading another node's blocks whole;
  ``cut_puts_shared_after``: the share of the blocks it put while cut off that another node finds
  once it is back; ``network_first_s`` / ``network_back_s``: link up until a TCP connect from the
  node to some / to every Redis node completed (bench/cluster/reach_watch.py: the kernel's floor,
  no daemon involved; a whole read needs every master), and ``rounds_after_network``: the rounds to
  recover that ended after ``network_back_s`` (the daemon's own share).
- ``node_blackholed``: the same node cut off the other way, every packet of its link dropped with
  its carrier up (a switch or router failing, ``Topology.blackhole``), then let through again. A
  link taken down loses its carrier, which flushes the node's neighbour table: after the heal
  nothing reaches the others before ARP's own retransmit, up to 1 s later (measured 1.0 s
  whatever the cut's length), so node_partitioned's recovery has that floor under it and this
  one shows the daemon's own.
- ``s3_slow``: S3's link shaped with tbf (both directions) for ``during`` rounds, then cleared;
  ``recovery_s``: cleared to the first round every node reads whole (reads are served from Redis
  first, so a slow S3 shows in the puts' write-through, ``round_s``).
- ``node_lost``: a node's daemon SIGKILLed; the others go on for ``during`` rounds (their
  ``others_hit_rate_during``), then a fresh daemon; ``recovery_s``: restart to its first whole read.
- ``daemon_restarted_smaller``: a node's daemon stopped (SIGTERM), one round without it, then
  started with a smaller cpu tier; ``recovery_s`` as for node_lost, and ``own_blocks_hits``: its blocks of before the restart read
  back from the shared tiers.

Each fault reports ``wrong_outputs`` (blocks read back with other bytes than written: must be 0),
``client_errors``, ``requests``, ``unavailable`` (operations not sent: the node's daemon was down),
``hits``/``asked`` over the whole window, ``round_s`` (the longest round), ``rounds_to_recover``
(1: the first round after the heal), ``recovered`` (False: no whole read within the limit; then
``recovery_s`` is None), ``during_s`` (each round's seconds with the fault in place),
``after_heal`` (each round after the heal: its seconds and the watched nodes' hits) and
``puts_not_landed`` (puts whose write-through had not landed when the put gave up waiting).
``repeated`` runs a fault ``plan.repeats`` times: counts summed, the median ``recovery_s`` with
every run's beside it.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from bench.cluster.harness import ClusterHarness
from bench.cluster.reach_watch import ReachWatch
from bench.cluster.rounds import Round, run_round, summed, tag


@dataclass
class Plan:
    count: int = 16  # blocks per node per round
    during: int = 2  # rounds with the fault in place
    max_rounds_after: int = 12  # rounds allowed to recover
    s3_rate_mbit: float = 20.0
    smaller_cpu: str = "1MiB"
    repeats: int = 3  # each fault injected this often; recovery_s is the median


class Driver:
    """Numbers the rounds across faults (every round's tags are fresh)."""

    def __init__(self, h: ClusterHarness, plan: Plan) -> None:
        self.h, self.plan, self.r = h, plan, 0

    def round(self, **kw: bool) -> Round:
        self.r += 1
        return run_round(self.h, self.r, self.plan.count, **kw)

    def run(self, inject: Callable[[], None], heal: Callable[[], None], watched: list[int],
            during: Callable[[list[Round]], bool] | None = None) -> dict[str, object]:
        """``during``: keep the fault in place until it returns True for the rounds so far (default:
        ``plan.during`` rounds)."""
        rounds: list[Round] = []
        t_inject = time.monotonic()
        inject()
        while True:
            rounds.append(self.round())
            if (during(rounds) if during else len(rounds) >= self.plan.during) or len(rounds) >= 30:
                break
        n_during = len(rounds)
        t_heal = time.monotonic()
        heal()
        recovered_at: Round | None = None
        for _ in range(self.plan.max_rounds_after):
            rounds.append(rnd := self.round())
            if all(rnd.full_hit(i) for i in watched):
                recovered_at = rnd
                break
        after = len(rounds) - n_during
        for _ in range(self.plan.max_rounds_after):  # settle: every node clean before the next fault
            if all(rounds[-1].full_hit(i) for i in range(len(self.h.nodes))):
                break
            rounds.append(self.round())
        total = summed(rounds)
        return {"wrong_outputs": total["wrong"], "client_errors": total["client_errors"],
                "recovery_s": round(recovered_at.t_end - t_heal, 3) if recovered_at else None,
                "recovered": recovered_at is not None, "rounds_to_recover": after if recovered_at else None,
                "requests": total["requests"], "unavailable": total["unavailable"], "hits": total["hits"],
                "asked": total["asked"], "rounds_during": n_during, "round_s": max(r.seconds for r in rounds),
                "inject_to_heal_s": round(t_heal - t_inject, 3),
                "errors_seen": sorted({e.split(":")[0] for r in rounds for e in r.errors}),
                "during_s": [r.seconds for r in rounds[:n_during]],
                "after_heal": [{"s": r.seconds, "watched_hits": [sum(int(a.get("hits", 0)) for _, a in r.gets.get(i, []))
                                                                 for i in watched]} for r in rounds[n_during:]],
                "puts_not_landed": sum(int(a.get("pending") or 0) > 0 for r in rounds for a in r.puts.values()),
                "tiers": {k[5:]: v for k, v in total.items() if k.startswith("tier_")}}


def redis_master_killed(d: Driver) -> dict[str, object]:
    cluster = d.h.redis
    cluster.wait_replicated()
    victim = cluster.masters()[0]
    heir = cluster.replicas_of(victim)[0]
    t_kill = 0.0
    promoted_s: list[float] = []

    def kill() -> None:
        nonlocal t_kill
        t_kill = time.monotonic()
        cluster.kill(victim)

    def promoted(_: list[Round]) -> bool:
        if cluster.roles()[heir] == "master":
            promoted_s.append(time.monotonic() - t_kill)
            return True
        return False

    out = d.run(kill, lambda: None, list(range(len(d.h.nodes))), during=promoted)
    if out["recovered"]:  # nothing heals a kill: count from it, not from the promotion
        out["recovery_s"] = round(float(out["recovery_s"]) + float(out["inject_to_heal_s"]), 3)  # type: ignore[arg-type]
    out["promoted_s"] = round(promoted_s[0], 3) if promoted_s else None
    out["redis_serving_again_s"] = _until_redis_serves(d, t_kill, out)
    cluster.start_node(victim)  # back as the heir's replica, for the faults after this one
    cluster.wait_ok()
    cluster.wait_until(lambda: victim in cluster.replicas_of(heir), f"redis node {victim} back as a replica")
    return out


def _until_redis_serves(d: Driver, t_kill: float, out: dict[str, object], limit_s: float = 30.0) -> float | None:
    """Rounds until Redis (not S3) answers every cross-node read again, whole: the seconds from the
    kill (None: not within ``limit_s``). The daemons detach the whole Redis tier once its calls fail
    (kvstore/store/breaker.py), so meanwhile S3 answers; these rounds' counts are added to ``out``."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        rnd = d.round()
        t = rnd.tally()
        for k, key in (("wrong_outputs", "wrong"), ("client_errors", "client_errors"), ("requests", "requests"),
                       ("hits", "hits"), ("asked", "asked")):
            out[k] = int(out[k]) + t[key]  # type: ignore[call-overload]
        if t["asked"] and t["tier_redis"] == t["asked"] and all(rnd.full_hit(i) for i in range(len(d.h.nodes))):
            return round(rnd.t_end - t_kill, 3)
        time.sleep(0.2)
    return None


def node_partitioned(d: Driver) -> dict[str, object]:
    return _cut(d, d.h.topo.link_down, d.h.topo.link_up)


def node_blackholed(d: Driver) -> dict[str, object]:
    return _cut(d, d.h.topo.blackhole, d.h.topo.clear_rate)


def _cut(d: Driver, inject: Callable[[str], None], heal: Callable[[str], None]) -> dict[str, object]:
    """The last node cut off by ``inject(its name)``, then ``heal(its name)``; from the heal a
    ``ReachWatch`` times when the network lets the node reach Redis again (``network_back_s``)."""
    node = len(d.h.nodes) - 1
    name = d.h.nodes[node]
    first = d.r + 1
    redis = [(str(u.hostname), int(u.port or 6379)) for u in map(urlsplit, d.h.redis.urls)]
    watches: list[ReachWatch] = []

    def healed() -> None:
        heal(name)
        watches.append(ReachWatch(d.h.topo.entered(name), redis).start())

    out = d.run(lambda: inject(name), healed, [node])
    out["network_first_s"], out["network_back_s"] = watches[0].stop() if watches else (None, None)
    back = out["network_back_s"]
    out["rounds_after_network"] = _rounds_after(out, back)
    out["node"] = name
    out["cut_puts_shared_after"] = _shared_later(d, node, range(first, first + int(out["rounds_during"])))  # type: ignore[call-overload]
    return out


def _rounds_after(out: dict[str, object], back: float | None) -> int | None:
    """Of the rounds after the heal up to the one that recovered, those that ended after the network
    let the node through again (``back`` s after the heal): the daemon's own share of the recovery.
    Rounds follow each other back to back, so a round's end is the sum of the rounds' seconds so far."""
    if back is None or not out["recovered"]:
        return None
    ends = itertools.accumulate(float(r["s"]) for r in out["after_heal"][:int(out["rounds_to_recover"])])  # type: ignore[index,call-overload]
    return sum(end > back for end in ends)


def _shared_later(d: Driver, node: int, rounds: range) -> float | None:
    """The share of the blocks ``node`` put (and was answered for) in ``rounds`` that another node
    finds in the shared tiers now: a put acknowledged while the node was cut off lands in its own
    cpu tier and its write-through to the shared tiers is skipped, its key kept in each tier's
    replay backlog; once the heal attaches a tier again the daemon writes those blocks there
    (kvstore/store/replay.py), so this is the share the replay delivered (1.0 unless a backlog
    overflowed or the replay had not landed yet when asked)."""
    reader = d.h.workers[(node + 1) % len(d.h.nodes)]
    if reader is None or not rounds:
        return None
    hits = asked = 0
    for r in rounds:
        reader.send("get", tag(r, node), d.plan.count)
        got = reader.receive(30.0)
        if "error" not in got:
            hits, asked = hits + int(got.get("hits", 0)), asked + d.plan.count  # type: ignore[call-overload]
    return round(hits / asked, 4) if asked else None


def s3_slow(d: Driver) -> dict[str, object]:
    out = d.run(lambda: d.h.topo.set_rate("s3", d.plan.s3_rate_mbit), lambda: d.h.topo.clear_rate("s3"),
                list(range(len(d.h.nodes))))
    out["rate_mbit"] = d.plan.s3_rate_mbit
    return out


def node_lost(d: Driver) -> dict[str, object]:
    node = 1 % len(d.h.nodes)
    others: list[Round] = []

    def counting_others(rounds: list[Round]) -> bool:
        others[:] = rounds
        return len(rounds) >= d.plan.during

    out = d.run(lambda: d.h.kill_node(node), lambda: d.h.start_node(node), [node], during=counting_others)
    during = summed(others)
    out["others_hit_rate_during"] = round(during["hits"] / during["asked"], 4) if during["asked"] else None
    out["node"] = d.h.nodes[node]
    return out


def daemon_restarted_smaller(d: Driver) -> dict[str, object]:
    node = 0
    before = d.r  # its last round's blocks: written through before the restart

    out = d.run(lambda: d.h.stop_node(node), lambda: d.h.start_node(node, cpu=d.plan.smaller_cpu), [node],
                during=lambda rounds: True)  # one round without it
    worker = d.h.workers[node]
    assert worker is not None
    worker.send("get", tag(before, node), d.plan.count)
    own = worker.receive(30.0)
    out["own_blocks_hits"], out["own_blocks_wrong"] = own.get("hits"), own.get("wrong")
    out["wrong_outputs"] = int(out["wrong_outputs"]) + int(own.get("wrong") or 0)  # type: ignore[call-overload]
    out["cpu"], out["node"] = d.plan.smaller_cpu, d.h.nodes[node]
    return out


EXTRAS: dict[str, Callable[[list[object]], object]] = {  # times: the median; shares and counts: the worst
    "promoted_s": statistics.median, "redis_serving_again_s": statistics.median,
    "others_hit_rate_during": min, "own_blocks_hits": min, "cut_puts_shared_after": min,
    "network_first_s": statistics.median, "network_back_s": statistics.median, "rounds_after_network": max}
SUMMED = ("wrong_outputs", "client_errors", "requests", "unavailable", "hits", "asked", "puts_not_landed")


def repeated(fault: Callable[[Driver], dict[str, object]], d: Driver) -> dict[str, object]:
    """``fault`` run ``plan.repeats`` times: counts summed over the runs, ``recovery_s`` the median
    (None if any run did not recover), ``recovery_s_runs`` and ``rounds_to_recover`` the worst run's,
    every run's own figures under ``runs``."""
    runs = [fault(d) for _ in range(d.plan.repeats)]
    out: dict[str, object] = {k: sum(int(r[k]) for r in runs) for k in SUMMED}  # type: ignore[call-overload]
    recovered = all(r["recovered"] for r in runs)
    secs = [float(r["recovery_s"]) for r in runs if r["recovery_s"] is not None]  # type: ignore[arg-type]
    out["recovery_s"] = statistics.median(secs) if recovered else None
    out["recovery_s_runs"] = secs
    out["recovered"] = recovered
    out["rounds_to_recover"] = max(int(r["rounds_to_recover"]) for r in runs) if recovered else None  # type: ignore[call-overload]
    out["round_s"] = max(float(r["round_s"]) for r in runs)  # type: ignore[arg-type]
    for key, pick in EXTRAS.items():  # a fault's own figures: over the runs, beside every run's
        if key in runs[0]:
            vals = [r[key] for r in runs]
            out[key] = pick(vals) if None not in vals else None  # type: ignore[arg-type]
            out[f"{key}_runs"] = vals
    out["runs"] = runs
    return out


FAULTS: dict[str, Callable[[Driver], dict[str, object]]] = {
    "redis_master_killed": redis_master_killed, "node_partitioned": node_partitioned,
    "node_blackholed": node_blackholed, "s3_slow": s3_slow,
    "node_lost": node_lost, "daemon_restarted_smaller": daemon_restarted_smaller}
