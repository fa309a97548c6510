"""Network namespaces, veth pairs and tbf through ``ip``/``tc``, and entering a namespace from Python.

Why these choices:
- Everything goes through the ``ip``/``tc`` binaries with ``-n NS`` (no library to install, the same
  commands a person would type to look at a topology); a failing command raises NetnsError with
  its stderr.
- ``entered(ns)`` moves the *calling thread* (not the process) into a namespace with setns(2), so a
  test's client (a RedisTier, a socket) lives on the topology's addresses while pytest and every
  other thread stay where they were. Sockets keep the namespace they were created in.
- ``unavailable()`` says why this machine cannot have namespaces at all (not root, ``ip netns add``
  refused): the one case where a test may skip rather than fail.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from functools import cache

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command failed, or a namespace could not be entered."""


def run(argv: Sequence[str], *, timeout_s: float = 10.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one ``ip``/``tc`` command; raise NetnsError with its stderr when it fails."""
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    if check and done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def exec_prefix(ns: str) -> list[str]:
    """The command prefix that runs a program inside ``ns`` (``ip netns exec`` execs it: same pid)."""
    return ["ip", "netns", "exec", ns]


def add(ns: str) -> None:
    run(["ip", "netns", "add", ns])
    run(["ip", "-n", ns, "link", "set", "lo", "up"])


def delete(ns: str) -> None:
    """Delete ``ns`` if it exists (its veth ends go with it, and their peers with them)."""
    run(["ip", "netns", "delete", ns], check=False)


def existing(prefix: str) -> list[str]:
    """Namespaces whose name starts with ``prefix``."""
    out = run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(prefix)]


def veth(a_ns: str, a_dev: str, b_ns: str, b_dev: str) -> None:
    """A veth pair with one end in each namespace (nothing is ever left in ours)."""
    run(["ip", "link", "add", a_dev, "netns", a_ns, "type", "veth", "peer", "name", b_dev, "netns", b_ns])


@cache
def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); this process is not root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the ip and tc binaries (iproute2) are not installed"
    probe = f"tkvprobe{secrets.token_hex(3)}"
    done = run(["ip", "netns", "add", probe], check=False)
    if done.returncode != 0:
        return f"this kernel refuses network namespaces: ip netns add: {done.stderr.strip()}"
    delete(probe)
    return None


_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise NetnsError(f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def entered(ns: str) -> Iterator[None]:
    """Run the calling thread inside ``ns`` for the block, then bring it back where it was."""
    with open("/proc/thread-self/ns/net", "rb") as home, open(f"{NETNS_DIR}/{ns}", "rb") as target:
        _setns(target.fileno())
        try:
            yield
        finally:
            _setns(home.fileno())
