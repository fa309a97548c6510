"""Start and stop a `kvstore serve` subprocess on a free loopback port (demo, benchmarks, tests).

The daemon prints ``kvstore listening on HOST:PORT`` once it serves; we read that line rather than
guess a port, so several daemons can start at once without racing for one. Each uses the token
file a client of this process finds by default (kvstore/server/auth.py), so callers pass no token.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvstore.server.auth import default_token_file

READY = "kvstore listening on "


def spawn_daemon(cache_dir: Path | str, *flags: str, env: dict[str, str] | None = None,
                 log_path: Path | None = None, listen: str = "127.0.0.1:0",
                 timeout_s: float = 60.0) -> tuple[subprocess.Popen[str], str]:
    """Start ``kvstore serve`` with its cache under ``cache_dir``; return (process, address) once serving.

    stderr goes to ``log_path`` (appended) or is discarded. Raises RuntimeError if it does not come up."""
    argv = [sys.executable, "-m", "kvstore", "serve", "--listen", listen, *flags]
    full_env = dict(os.environ, TIERKV_CACHE_DIR=str(cache_dir), PYTHONUNBUFFERED="1", **(env or {}))
    if not {"TIERKV_TOKEN", "TIERKV_TOKEN_FILE"} & set(full_env) and "--token-file" not in flags:
        # the token where a client of *this* process looks by default (not under cache_dir)
        full_env["TIERKV_TOKEN_FILE"] = str(default_token_file())
    err = open(log_path, "a") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=full_env)
    finally:
        if log_path is not None:
            err.close()  # type: ignore[union-attr]
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(READY):
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


@contextmanager
def running_daemon(cache_dir: Path | str, *flags: str, env: dict[str, str] | None = None,
                   log_path: Path | None = None) -> Iterator[str]:
    """A daemon for the duration of a ``with`` block; yields its address."""
    proc, address = spawn_daemon(cache_dir, *flags, env=env, log_path=log_path)
    try:
        yield address
    finally:
        stop_daemon(proc)
