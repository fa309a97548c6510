"""A kvstore daemon per node of a Topology, sharing the cluster's Redis, and clients beside it.

``NodeDaemon(topo, "node0", workdir, redis_url, "--cpu", "4MiB")`` starts ``kvstore serve`` inside
the node's namespace (bench/servers.py's ``spawn_daemon`` behind ``ip netns exec``) with the Redis
Cluster as its shared tier (``--redis URL --redis-cluster``): its traffic to Redis crosses the node's
link, so the topology's faults (``link_down``, ``set_rate``) are the daemon's. It listens on the
node's loopback; ``client(op, ...)`` runs bench/cluster/node_client.py in the same namespace and
returns its JSON. ``kill()`` SIGKILLs the daemon; ``env`` is set over ours (S3 keys); ``redis_url``
"" gives it no Redis tier (its flags name the others). Each daemon gets its own shared-memory
socket path (ports repeat across namespaces, so the default ``shm-PORT.sock`` in the shared
runtime directory could clash).
``lookups(count)`` keeps one such client running: ``ask(tag)`` times one lookup request.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.cluster.topology import Topology
from bench.servers import spawn_daemon, stop_daemon


class NodeDaemonError(RuntimeError):
    """A node's client failed (its stderr is in the message)."""


class NodeDaemon:
    def __init__(self, topo: Topology, node: str, workdir: Path, redis_url: str, *flags: str,
                 timeout_s: float = 60.0, env: dict[str, str] | None = None) -> None:
        self.topo, self.node = topo, node
        self.workdir = workdir / node
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / "daemon.log"
        self.proc, self.address = spawn_daemon(
            self.workdir / "cache", *(("--redis", redis_url, "--redis-cluster") if redis_url else ()),
            "--shm-socket", str(self.workdir / "shm.sock"), *flags,
            log_path=self.log_path, listen="127.0.0.1:0", timeout_s=timeout_s, prefix=topo.exec_prefix(node),
            env=env)

    def client(self, op: str, tag: str, count: int = 16, *extra: str, timeout_s: float = 90.0) -> dict[str, object]:
        """Run ``node_client ADDRESS op --tag tag --count count`` inside this node's namespace."""
        argv = [*self.topo.exec_prefix(self.node), sys.executable, "-m", "bench.cluster.node_client",
                self.address, op, "--tag", tag, "--count", str(count), *extra]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise NodeDaemonError(f"{op} on {self.node} failed ({done.returncode}):\n{done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    def lookups(self, count: int = 4) -> LookupSession:
        """One client process in the node's namespace, timing a lookup per ``ask`` (node_client lookups)."""
        argv = [*self.topo.exec_prefix(self.node), sys.executable, "-m", "bench.cluster.node_client",
                self.address, "lookups", "--tag", "-", "--count", str(count)]
        return LookupSession(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))

    def stop(self) -> None:
        stop_daemon(self.proc)

    def kill(self) -> None:
        """SIGKILL: no shutdown path runs (the node-lost fault)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def __enter__(self) -> NodeDaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LookupSession:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc

    def ask(self, tag: str) -> dict[str, object]:
        """One lookup request of ``tag``'s keys: ``{"s": seconds, "tiers": [...]}`` or ``{"s", "error"}``."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(tag + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise NodeDaemonError(f"the lookup client ended ({self.proc.poll()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> LookupSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
