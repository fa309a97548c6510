"""One redis-server listening on loopback TCP *and* a unix socket, for bench.tiers.daemon: the same
values reached over either transport, so each side of a daemon-vs-Redis ratio can be set against
Redis on its own kind of transport (TCP against TCP; the daemon's shared memory against Redis's
best same-host transport, a unix socket). bench.servers.redis_server has no unix socket, and a
running redis cannot open one (``unixsocket`` is not settable at runtime)."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from bench.servers import LOOPBACK, ServerError, find_binary, free_port


class RedisUrls(NamedTuple):
    tcp: str  # redis://127.0.0.1:PORT/0
    unix: str  # unix:///DIR/redis.sock?db=0


@contextlib.contextmanager
def redis_tcp_and_unix(timeout_s: float = 10.0) -> Iterator[RedisUrls]:
    import redis

    with tempfile.TemporaryDirectory(prefix="tierkv-redis-unix-") as d:
        sock, port = Path(d) / "redis.sock", free_port()
        argv = [find_binary("redis-server"), "--port", str(port), "--bind", LOOPBACK, "--unixsocket", str(sock),
                "--unixsocketperm", "700", "--dir", d, "--save", "", "--appendonly", "no",
                "--protected-mode", "no", "--daemonize", "no"]
        with open(Path(d) / "redis.log", "w") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            urls = RedisUrls(f"redis://{LOOPBACK}:{port}/0", f"unix://{sock}?db=0")
            end = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise ServerError(f"redis-server exited: {(Path(d) / 'redis.log').read_text()[-2000:]}")
                try:
                    if all(redis.Redis.from_url(u, socket_timeout=1).ping() for u in urls):
                        break
                except (redis.exceptions.ConnectionError, OSError):
                    pass
                if time.monotonic() > end:
                    raise ServerError("redis-server with a unix socket did not answer")
                time.sleep(0.05)
            yield urls
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
