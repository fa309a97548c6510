"""The whole cluster of the bench, up and torn down as one: nodes, Redis Cluster, S3, a daemon and a
client worker per node.

``with ClusterHarness(workdir, nodes=3) as h:`` builds a Topology (``node0`` ... and services
``redis0``-``redis5``, ``s3``), a Redis Cluster of 3 masters + 3 replicas (node timeout 1 s) in the
redis namespaces, SeaweedFS in the ``s3`` namespace, then on every node a kvstore daemon whose chain
is cpu -> Redis Cluster -> S3, both shared tiers written through (every put is copied to both at
once, so another node finds a block in either), and a bench/cluster/node_worker.py beside it.

Faults act on the pieces: ``h.topo.link_down``/``set_rate`` (links), ``h.redis.kill`` (a master),
``h.kill_node(i)`` (the daemon SIGKILLed, its worker gone) and ``h.start_node(i, cpu=...)`` (a fresh
daemon and worker; its cpu tier empty). Leaving the block (also on an error or KeyboardInterrupt)
stops every worker, daemon and server and deletes every namespace: the pieces are pushed on an
ExitStack as they start, so a bring-up failing half way tears down what it made.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

from bench.cluster.nodes import NodeDaemon
from bench.cluster.redis_cluster import RedisCluster, RedisClusterConfig, in_topology
from bench.cluster.topology import Topology, TopologyConfig
from bench.cluster.worker_session import WorkerSession
from bench.servers import SeaweedS3, prepare_bucket

REDIS = tuple(f"redis{i}" for i in range(6))
BUCKET = "tierkv-cluster"
NODE_TIMEOUT_MS = 1000
TIER_RETRY_S = 0.5  # the daemons' first probe of a detached tier (backoff to 10x): recorded in meta


class ClusterHarness:
    def __init__(self, workdir: Path, nodes: int = 3, cpu: str = "4MiB", floats: int = 16 * 1024,
                 put_wait_s: float = 5.0, prefix: str = "") -> None:
        self.workdir, self.cpu, self.floats, self.put_wait_s = workdir, cpu, floats, put_wait_s
        self._stack = contextlib.ExitStack()
        try:
            self.topo = self._stack.enter_context(Topology(TopologyConfig(nodes=nodes, services=(*REDIS, "s3"),
                                                                          prefix=prefix)))
            self.redis: RedisCluster = self._stack.enter_context(
                in_topology(self.topo, REDIS, workdir / "redis",
                            RedisClusterConfig(replicas=1, node_timeout_ms=NODE_TIMEOUT_MS)))
            (workdir / "s3").mkdir(parents=True, exist_ok=True)
            self.s3 = SeaweedS3(workdir / "s3", host=self.topo.addr("s3"), netns=self.topo.ns("s3"))
            self._stack.callback(self.s3.stop)
            with self.topo.entered("node0"):
                prepare_bucket(self.s3.endpoint, BUCKET)
            self.daemons: list[NodeDaemon | None] = [None] * nodes
            self.workers: list[WorkerSession | None] = [None] * nodes
            self._stack.callback(self._stop_nodes)
            for i in range(nodes):
                self.start_node(i)
        except BaseException:
            self._stack.close()
            raise

    @property
    def nodes(self) -> list[str]:
        return self.topo.nodes

    def _config(self, i: int, cpu: str, redis: bool) -> Path:
        path = self.workdir / f"node{i}.yaml"
        tiers = [f"{{kind: cpu, capacity: {cpu}}}", "{kind: redis, capacity: 1GiB}",
                 "{kind: s3, capacity: 1GiB, write_through: true}"]
        if not redis:
            del tiers[1]
        path.write_text(f"tier_retry_s: {TIER_RETRY_S}\nstats_interval_s: 0\ntiers:\n"
                        + "".join(f"  - {t}\n" for t in tiers))
        return path

    def start_node(self, i: int, cpu: str | None = None, redis: bool = True, s3_url: str | None = None) -> None:
        """A fresh daemon on node ``i`` (cpu tier ``cpu``, default the harness's; ``redis`` False: no
        Redis tier, cpu -> S3; ``s3_url``: reach S3 there instead, such as a delay proxy in the
        node's namespace) and its worker."""
        ep = self.s3.endpoint
        env = {"AWS_ACCESS_KEY_ID": ep.access_key, "AWS_SECRET_ACCESS_KEY": ep.secret_key,
               "AWS_DEFAULT_REGION": ep.region}
        daemon = NodeDaemon(self.topo, self.nodes[i], self.workdir, ",".join(self.redis.urls) if redis else "",
                            "--config", str(self._config(i, cpu or self.cpu, redis)), "--s3", f"s3://{BUCKET}/kv",
                            "--s3-endpoint", s3_url or ep.url, env=env)
        self.daemons[i] = daemon
        argv = [*self.topo.exec_prefix(self.nodes[i]), sys.executable, "-m", "bench.cluster.node_worker",
                daemon.address, "--floats", str(self.floats), "--wait-s", str(self.put_wait_s)]
        self.workers[i] = WorkerSession(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                         stderr=subprocess.DEVNULL, text=True))

    def kill_node(self, i: int) -> None:
        """SIGKILL node ``i``'s daemon (nothing is flushed) and end its worker."""
        self._end_node(i, kill=True)

    def stop_node(self, i: int) -> None:
        """Stop node ``i``'s daemon politely (SIGTERM) and its worker."""
        self._end_node(i, kill=False)

    def _end_node(self, i: int, kill: bool) -> None:
        if (w := self.workers[i]) is not None:
            w.close()
            self.workers[i] = None
        if (d := self.daemons[i]) is not None:
            d.kill() if kill else d.stop()
            self.daemons[i] = None

    def _stop_nodes(self) -> None:
        for i in range(len(self.daemons)):
            self.kill_node(i)  # the bench's data is throwaway: no flush to wait for

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> ClusterHarness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
