"""A real Redis Cluster (``redis-server --cluster-enabled yes``), on loopback or in a topology's namespaces.

``RedisCluster(places, workdir, RedisClusterConfig(replicas=1))`` starts one redis-server per
place, joins them with ``redis-cli --cluster create ... --cluster-replicas N --cluster-yes`` and
waits until every node says ``cluster_state:ok`` with all 16384 slots assigned. A place is where a
server listens and how to run a program there: ``RedisPlace(host, port, prefix)``, ``prefix`` being
empty on loopback or ``ip netns exec NS`` for a namespace (``in_topology`` builds one per service
of a Topology, each on its own address). bench/servers.py's ``redis_cluster()`` is this class on
loopback ports.

Failover is on (Redis's default): ``kill(i)`` SIGKILLs a node, ``wait_ok()`` waits until the live
nodes agree again, ``wait_promoted(j)`` until replica j has taken over, ``roles()``/``masters()``
say who is master now, and ``wait_replicated()`` waits until the masters' replicas have
acknowledged all they were sent (replication is asynchronous: a write answered just before a
master dies may be lost; the cluster serves a miss for it, never other bytes). ``start_node(i)`` brings a killed node back with its nodes.conf (it rejoins as a replica).
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench.servers import ServerError, _Process, _redis_argv, _wait_until, find_binary

if TYPE_CHECKING:
    from bench.cluster.topology import Topology

CLUSTER_SLOTS = 16384


@dataclass(frozen=True)
class RedisPlace:
    host: str
    port: int
    prefix: tuple[str, ...] = ()  # runs a program there: () on loopback, ("ip", "netns", "exec", NS)


@dataclass(frozen=True)
class RedisClusterConfig:
    replicas: int = 0  # per master; the first len(places) / (replicas + 1) places become masters
    node_timeout_ms: int = 3000  # a master unreachable this long is failed over to a replica
    ready_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.replicas < 0 or self.node_timeout_ms <= 0:
            raise ValueError(f"bad redis cluster config {self}")


class RedisCluster:
    def __init__(self, places: Sequence[RedisPlace], workdir: Path,
                 config: RedisClusterConfig = RedisClusterConfig(), *, start: bool = True) -> None:
        if len(places) < 3 * (config.replicas + 1):
            raise ValueError(f"redis-cli --cluster create needs 3 masters: {len(places)} places, "
                             f"{config.replicas} replicas each")
        self.places, self.config, self.workdir = list(places), config, workdir
        self.urls = [f"redis://{p.host}:{p.port}/0" for p in self.places]
        self._procs: list[_Process | None] = [None] * len(self.places)
        if start:
            try:
                self.start()
            except BaseException:
                self.stop()
                raise

    # -- one node -----------------------------------------------------------------------------
    def cli(self, i: int, *args: str, timeout_s: float = 5.0) -> str:
        """``redis-cli`` against node ``i`` (run where it can reach it); its stdout."""
        p = self.places[i]
        argv = [*p.prefix, find_binary("redis-cli"), "-h", p.host, "-p", str(p.port), *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s).stdout

    def start_node(self, i: int) -> None:
        """(Re)start node ``i`` on its place and data directory (its nodes.conf says who it was)."""
        self._spawn_node(i)
        self._wait_pong(i)

    def _wait_pong(self, i: int) -> None:
        proc = self._procs[i]
        assert proc is not None
        _wait_until(lambda: self.cli(i, "ping").strip() == "PONG", [proc], 10, proc.label)

    def _spawn_node(self, i: int) -> None:
        p = self.places[i]
        wd = self.workdir / f"{p.host}-{p.port}"
        wd.mkdir(parents=True, exist_ok=True)
        extra = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                 "--cluster-node-timeout", str(self.config.node_timeout_ms),
                 "--cluster-replica-validity-factor", "0"]  # a replica always may take over
        label = f"redis-cluster-{p.host}:{p.port}"
        self._procs[i] = _Process(_redis_argv(p.port, wd, extra, bind=p.host), wd / "redis.log", label,
                                  cwd=wd, prefix=p.prefix)

    def kill(self, i: int) -> None:
        """SIGKILL node ``i``: no shutdown path runs, its replica is promoted after the node timeout."""
        proc = self._procs[i]
        if proc is not None and proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait(10)

    def alive(self, i: int) -> bool:
        proc = self._procs[i]
        return proc is not None and proc.proc.poll() is None

    def pid(self, i: int) -> int | None:
        proc = self._procs[i]
        return proc.proc.pid if proc is not None and proc.proc.poll() is None else None

    # -- the cluster --------------------------------------------------------------------------
    def start(self) -> None:
        for i in range(len(self.places)):  # all at once, then wait for each
            self._spawn_node(i)
        for i in range(len(self.places)):
            self._wait_pong(i)
        addrs = [f"{p.host}:{p.port}" for p in self.places]
        create = subprocess.run(
            [*self.places[0].prefix, find_binary("redis-cli"), "--cluster", "create", *addrs,
             "--cluster-replicas", str(self.config.replicas), "--cluster-yes"],
            capture_output=True, text=True, timeout=60)
        if create.returncode != 0:
            raise ServerError(f"redis-cli --cluster create failed:\n{create.stdout}\n{create.stderr}")
        self.wait_ok()
        if self.config.replicas:
            self.wait_until(lambda: len(self.masters()) * (self.config.replicas + 1) == len(self.places),
                       "every replica attached")

    def ok(self, i: int) -> bool:
        info = self.cli(i, "cluster", "info")
        return "cluster_state:ok" in info and f"cluster_slots_assigned:{CLUSTER_SLOTS}" in info

    def wait_ok(self, timeout_s: float | None = None) -> None:
        """Until every live node says cluster_state:ok with all slots assigned."""
        self.wait_until(lambda: all(self.ok(i) for i in range(len(self.places)) if self.alive(i)),
                   "redis cluster_state:ok", timeout_s)

    def roles(self) -> list[str | None]:
        """``master``/``slave`` for each node as it says itself (None: not running)."""
        out: list[str | None] = []
        for i in range(len(self.places)):
            first = self.cli(i, "role").split("\n", 1)[0].strip() if self.alive(i) else ""
            out.append(first or None)
        return out

    def masters(self) -> list[int]:
        return [i for i, role in enumerate(self.roles()) if role == "master"]

    def replicas_of(self, i: int) -> list[int]:
        """The nodes replicating master ``i`` (from its INFO replication)."""
        info = self.cli(i, "info", "replication")
        peers = {f"ip={p.host},port={p.port}": j for j, p in enumerate(self.places)}
        return [j for line in info.splitlines() if line.startswith("slave")
                for key, j in peers.items() if key + "," in line + ","]

    def wait_replicated(self, *masters: int, timeout_s: float | None = None) -> None:
        """Until each replica of each of ``masters`` (none given: every master now) has acknowledged
        all of its master's replication stream (replicas acknowledge once a second: one wait for all)."""
        todo = list(masters) or self.masters()

        def caught_up(i: int) -> bool:
            info = dict(line.split(":", 1) for line in self.cli(i, "info", "replication").splitlines()
                        if ":" in line)
            offset = int(info["master_repl_offset"])
            slaves = [v for k, v in info.items() if k.startswith("slave") and k[5:].isdigit()]
            return bool(slaves) and all(f"offset={offset}," in v + "," for v in slaves)

        self.wait_until(lambda: all([caught_up(i) for i in todo]), f"replicas of nodes {todo} caught up", timeout_s)

    def wait_promoted(self, i: int, timeout_s: float | None = None) -> None:
        """Until node ``i`` (a replica of a killed master) is master and the live nodes are ok again."""
        self.wait_until(lambda: self.alive(i) and self.cli(i, "role").startswith("master"), f"node {i} promoted",
                   timeout_s)
        self.wait_ok(timeout_s)

    def wait_until(self, ready: Callable[[], bool], what: str, timeout_s: float | None = None) -> None:
        live = [p for p in self._procs if p is not None and p.proc.poll() is None]
        _wait_until(ready, live, timeout_s or self.config.ready_timeout_s, what, every_s=0.1)

    def stop(self) -> None:
        for proc in self._procs:
            if proc is not None:
                proc.stop(grace_s=1)

    def __enter__(self) -> RedisCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def in_topology(topo: Topology, services: Sequence[str], workdir: Path,
                config: RedisClusterConfig = RedisClusterConfig(replicas=1), port: int = 6379) -> RedisCluster:
    """One node per service of a bench.cluster.topology.Topology, each on its own address and namespace."""
    places = [RedisPlace(topo.addr(s), port, tuple(topo.exec_prefix(s))) for s in services]
    return RedisCluster(places, workdir, config)


@contextlib.contextmanager
def on_loopback(nodes: int, workdir: Path, config: RedisClusterConfig = RedisClusterConfig()) -> Iterator[RedisCluster]:
    """``nodes`` servers on free loopback ports (each with its cluster bus port, +10000, free too)."""
    from bench.servers import LOOPBACK, free_port

    ports: list[int] = []
    while len(ports) < nodes:
        if (port := free_port(also_free=(10000,))) not in ports:
            ports.append(port)
    with RedisCluster([RedisPlace(LOOPBACK, p) for p in ports], workdir, config) as cluster:
        yield cluster

