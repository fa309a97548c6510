"""The soak's processes: redis-server, SeaweedFS, one ``kvstore serve`` over cpu + disk + s3 + redis,
and two ``kvengine serve`` replicas that share it — each one a handle that can be SIGKILLed and
brought back on the same address (the fault schedule's verbs: bench/soak/run.py).

Tenants are credentials (bench/soak/tenancy.py): the daemon takes a credentials file (a token per
tenant, the engines' token listing every tenant they serve, an admin's), the replicas take the
engines' token and an API key per tenant. The daemon serves /metrics (its corrupt-block counter is
what the forged-block probe reads).

Every process runs in its own session under ``work``, with its log there; ``Cluster`` stops them
all on exit, whatever happened. ``processes()`` names what the watcher samples: each replica and
the daemon as they are *now* (a restarted daemon is a new process: bench/soak/watch.py keeps
each incarnation apart).
"""

from __future__ import annotations

import re
import subprocess
import urllib.request
from pathlib import Path

from bench.servers import (
    EngineServer,
    RedisServer,
    SeaweedS3,
    free_port,
    prepare_bucket,
    spawn_daemon,
    stop_daemon,
)
from bench.soak.tenancy import SoakCredentials
from kvstore.client.client import KVStoreClient
from kvstore.client.retry import Retry
from kvstore.errors import KVStoreError
from kvstore.server.auth import ClientAuth

BUCKET = "soak"


class Replica(EngineServer):
    """One ``kvengine serve`` on the real model, attached to the daemon, in its own session."""

    def __init__(self, name: str, work: Path, daemon: str, token: str, api_keys: Path, flags: list[str]) -> None:
        self.name = name
        env = {"TIERKV_TOKEN": token, "OMP_NUM_THREADS": "1",
               "TIERKV_CONNECTOR_WRITE_THROUGH": "true"}  # the daemon gets each prompt's pages at once
        super().__init__("--kvstore", daemon, "--threads", "1", "--api-keys", str(api_keys), *flags, env=env,
                         log_path=work / f"{name}.log", new_session=True, label=name)  # fmt: skip


class Daemon:
    """``kvstore serve`` with every tier; ``kill()`` then ``start()`` keeps its address."""

    def __init__(self, work: Path, redis: RedisServer, s3: SeaweedS3, credentials: Path, admin: str) -> None:
        """``admin``: the admin credential's token, for the soak's own Stats calls."""
        ep = s3.endpoint
        self.work, self.token, self.address = work, admin, "127.0.0.1:0"
        self.metrics_port = free_port()
        self.flags = ("--cpu", "64Mi", "--disk", f"{work}/disk:512Mi", "--redis", redis.url, "--s3",
                      f"s3://{BUCKET}/kv/", "--s3-endpoint", ep.url, "--credentials-file", str(credentials),
                      "--metrics-port", str(self.metrics_port))  # fmt: skip
        self.env = {"AWS_ACCESS_KEY_ID": ep.access_key, "AWS_SECRET_ACCESS_KEY": ep.secret_key,
                    "TIERKV_TIER_RETRY_S": "0.5", "TIERKV_STATS_INTERVAL_S": "0"}  # fmt: skip
        self.proc: subprocess.Popen[str] | None = None
        self.incarnation = 0
        self._stats: KVStoreClient | None = None

    def start(self) -> None:
        self.proc, self.address = spawn_daemon(self.work / "cache", *self.flags, env=self.env,
                                               log_path=self.work / "daemon.log", listen=self.address)  # fmt: skip
        self.incarnation += 1

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)
        self.proc = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def queued_bytes(self) -> int:
        """Bytes waiting in the daemon's spill queue (0 while it is down or does not answer at once)."""
        if self.pid is None:
            return 0
        if self._stats is None:
            self._stats = KVStoreClient(self.address, auth=ClientAuth(self.token), deadline_s=1.0, use_shm=False,
                                        retry=Retry(attempts=1))  # fmt: skip
        try:
            return self._stats.stats().pending_bytes
        except KVStoreError:
            return 0

    def corrupt_blocks(self) -> dict[tuple[str, str], float] | None:
        """``tierkv_tier_corrupt_blocks_total`` by (tier, reason) now; None while the daemon does not answer."""
        if self.pid is None:
            return None
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
                text = r.read().decode()
        except OSError:
            return None
        return parse_corrupt(text)

    def stop(self) -> None:
        if self._stats is not None:
            self._stats.close()
            self._stats = None
        if self.proc is not None:
            stop_daemon(self.proc)
            self.proc = None


class Cluster:
    """Everything the soak runs, started in order and stopped in reverse."""

    def __init__(self, work: Path, replica_flags: list[str]) -> None:
        self.work, self.replica_flags = work, replica_flags
        self.creds = SoakCredentials()
        self.credentials_file, self.api_keys_file = self.creds.write(work)
        self.token = self.creds.admin  # the admin's: the probes' witness, the watcher's Stats
        self.replicas: list[Replica] = []
        self.redis = RedisServer(_mkdir(work / "redis"))
        try:
            self.s3 = SeaweedS3(_mkdir(work / "weed"))
            prepare_bucket(self.s3.endpoint, BUCKET)
        except BaseException:
            self.redis.stop()
            raise
        self.daemon = Daemon(work, self.redis, self.s3, self.credentials_file, self.creds.admin)

    def start(self, replicas: int = 2, timeout_s: float = 300.0) -> None:
        """The daemon, then the replicas (loading the model side by side); call inside ``with``."""
        self.daemon.start()
        for i in range(replicas):
            self.replicas.append(Replica(f"replica-{chr(97 + i)}", self.work, self.daemon.address, self.creds.engines,
                                         self.api_keys_file, self.replica_flags))  # fmt: skip
        for r in self.replicas:
            r.wait_ready(timeout_s)

    def processes(self) -> dict[str, int | None]:
        """role -> pid of the process in that role now (None while it is down)."""
        procs: dict[str, int | None] = {r.name: r.proc.pid if r.proc.poll() is None else None for r in self.replicas}
        procs["daemon"] = self.daemon.pid
        return procs

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        for r in self.replicas:
            r.stop()
        self.daemon.stop()
        self.s3.stop()
        self.redis.stop()


_CORRUPT = re.compile(r'^tierkv_tier_corrupt_blocks_total\{([^}]*)\} ([0-9.eE+-]+)$', re.M)


def parse_corrupt(text: str) -> dict[tuple[str, str], float]:
    """(tier, reason) -> count, from a /metrics page."""
    out: dict[tuple[str, str], float] = {}
    for labels, value in _CORRUPT.findall(text):
        kv = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        out[(kv.get("tier", ""), kv.get("reason", ""))] = float(value)
    return out


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p
