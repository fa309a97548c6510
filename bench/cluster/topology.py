"""A small cluster's network: one namespace per node and per service, joined through a bridge.

``Topology(TopologyConfig(nodes=3, services=("redis", "s3")))`` creates, under a prefix unique to
the run (so parallel runs and tests never clash):

- ``PREFIX-br``: the bridge namespace, holding bridge ``br0`` and one port per member;
- ``PREFIX-node0`` ... and ``PREFIX-redis``, ``PREFIX-s3`` ...: one namespace per member, each with
  loopback up and one veth (``SUBNET.2``, ``.3``, ... in order: nodes first, then services) whose
  peer is that member's port on the bridge.

Nothing is created in the caller's namespace and nothing routes out of the subnet: traffic stays
in these namespaces (and their loopbacks). Faults are on the member's link: ``set_rate`` puts a
``tbf`` on both ends of its veth (both directions shaped), ``link_down`` takes its bridge port
down (a cut cable: packets are dropped, connections time out), ``link_up`` heals it.

``spawn(member, argv)`` runs a process inside a member's namespace (bench/servers.py's process
wrapper behind ``ip netns exec``); ``entered(member)`` runs the calling thread there (a test's
client). Leaving the ``with`` block, or ``close()``, stops every spawned process and deletes every
namespace, also when building the topology failed half way. ``NamespacesUnavailable`` is raised
only where this machine cannot make namespaces at all (tests skip on it, and on nothing else).
"""

from __future__ import annotations

import contextlib
import re
import secrets
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.cluster import netns
from bench.servers import _Process

BRIDGE = "br0"
_NAME = re.compile(r"^[a-z][a-z0-9]*$")


class TopologyError(RuntimeError):
    """The topology could not be built or used."""


class NamespacesUnavailable(TopologyError):
    """This machine cannot make network namespaces (not root, or the kernel refuses them)."""


@dataclass(frozen=True)
class TopologyConfig:
    nodes: int = 3
    services: tuple[str, ...] = ("redis", "s3")
    subnet: str = "10.77.0"  # a /24: members get .2, .3, ... (the bridge itself has no address)
    prefix: str = ""  # "" picks a fresh one: "tk" and 6 hex digits

    def __post_init__(self) -> None:
        if self.nodes < 0 or self.nodes + len(self.services) == 0:
            raise ValueError(f"topology needs at least one member, got {self.nodes} nodes, {self.services}")
        if self.nodes + len(self.services) > 250:
            raise ValueError("a /24 holds at most 250 members")
        if not re.fullmatch(r"\d{1,3}\.\d{1,3}\.\d{1,3}", self.subnet):
            raise ValueError(f"subnet is the first three octets of a /24, got {self.subnet!r}")
        if self.prefix and not (_NAME.match(self.prefix) and len(self.prefix) <= 10):
            raise ValueError(f"prefix: at most 10 of [a-z0-9], starting with a letter, got {self.prefix!r}")
        for name in self.services:
            if not _NAME.match(name) or name.startswith("node") or name == "br":
                raise ValueError(f"service names are [a-z0-9] (not nodeN, not br), got {name!r}")
        if len(set(self.services)) != len(self.services):
            raise ValueError(f"duplicate service names in {self.services}")


class Topology:
    def __init__(self, config: TopologyConfig = TopologyConfig()) -> None:
        if (why := netns.unavailable()) is not None:
            raise NamespacesUnavailable(why)
        self.config = config
        self.prefix = config.prefix or f"tk{secrets.token_hex(3)}"
        self.members: list[str] = [f"node{i}" for i in range(config.nodes)] + list(config.services)
        self.bridge_ns = f"{self.prefix}-br"
        self._procs: list[_Process] = []
        self._made: list[str] = []  # the namespaces this run created: the only ones close() deletes
        self._closed = False
        if netns.existing(f"{self.prefix}-"):  # before anything is ours: close() must not touch them
            self._closed = True
            raise TopologyError(f"namespaces with prefix {self.prefix}- exist already: another run owns them")
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # -- naming -----------------------------------------------------------------------------
    def _index(self, member: str) -> int:
        try:
            return self.members.index(member)
        except ValueError:
            raise TopologyError(f"no member {member!r} in {self.members}") from None

    def ns(self, member: str) -> str:
        """The namespace of ``member`` (a node ``nodeN`` or a service name)."""
        return f"{self.prefix}-{self.members[self._index(member)]}"

    def addr(self, member: str) -> str:
        return f"{self.config.subnet}.{self._index(member) + 2}"

    def dev(self, member: str) -> str:
        """The member's end of its veth (in its namespace); ``+ 'b'`` ends the bridge's port."""
        return f"{self.prefix}{self._index(member)}v"  # at most 10 + 3 + 1 characters: under IFNAMSIZ

    def port(self, member: str) -> str:
        return f"{self.prefix}{self._index(member)}b"

    @property
    def nodes(self) -> list[str]:
        return self.members[: self.config.nodes]

    # -- building and tearing down ----------------------------------------------------------
    def _build(self) -> None:
        self._add_ns(self.bridge_ns)
        netns.run(["ip", "-n", self.bridge_ns, "link", "add", BRIDGE, "type", "bridge"])
        netns.run(["ip", "-n", self.bridge_ns, "link", "set", BRIDGE, "up"])
        for member in self.members:
            ns, dev, port = self.ns(member), self.dev(member), self.port(member)
            self._add_ns(ns)
            netns.veth(ns, dev, self.bridge_ns, port)
            netns.run(["ip", "-n", self.bridge_ns, "link", "set", port, "master", BRIDGE, "up"])
            netns.run(["ip", "-n", ns, "addr", "add", f"{self.addr(member)}/24", "dev", dev])
            netns.run(["ip", "-n", ns, "link", "set", dev, "up"])

    def _add_ns(self, ns: str) -> None:
        self._made.append(ns)  # first: a namespace half made (lo not up yet) is still deleted
        netns.add(ns)

    def close(self) -> None:
        """Stop what was spawned, then delete every namespace of this run (idempotent)."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for proc in reversed(self._procs):
            try:
                proc.stop(grace_s=2)
            except Exception as e:  # noqa: BLE001 - keep tearing down; reported below
                errors.append(e)
        for ns in reversed(self._made):
            netns.delete(ns)
        if left := sorted(set(self._made) & set(netns.existing(f"{self.prefix}-"))):
            raise TopologyError(f"namespaces left after teardown: {left}")
        if errors:
            raise TopologyError(f"stopping spawned processes failed: {errors}")

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- faults -----------------------------------------------------------------------------
    def set_rate(self, member: str, rate_mbit: float) -> None:
        """Shape ``member``'s link to ``rate_mbit`` in both directions (tbf on both veth ends)."""
        if rate_mbit <= 0:
            raise ValueError(f"rate_mbit must be > 0, got {rate_mbit}")
        rate_bytes = rate_mbit * 1e6 / 8
        burst = max(16 << 10, int(rate_bytes / 250))  # 4 ms of traffic: what one timer tick lets through
        args = ["root", "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms"]
        for ns, dev in self._link_ends(member):
            netns.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, *args])

    def clear_rate(self, member: str) -> None:
        for ns, dev in self._link_ends(member):
            netns.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)  # none: fine

    def qdisc(self, member: str) -> str:
        """``tc qdisc show`` of the member's end of its link."""
        return netns.run(["tc", "-n", self.ns(member), "qdisc", "show", "dev", self.dev(member)]).stdout

    def blackhole(self, member: str) -> None:
        """Drop every packet on ``member``'s link, both ways, its carrier left up: a failure past
        the node's own port (a switch, a router), unlike ``link_down``, whose carrier loss flushes
        the node's neighbour table so that the heal waits for ARP's 1 s retransmit. A tbf whose
        bucket holds no packet; ``clear_rate`` heals it."""
        for ns, dev in self._link_ends(member):
            netns.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", "8bit", "burst", "1",
                       "limit", "1"])

    def link_down(self, member: str) -> None:
        """Cut ``member`` off: its bridge port goes down, its packets are dropped."""
        netns.run(["ip", "-n", self.bridge_ns, "link", "set", self.port(member), "down"])

    def link_up(self, member: str) -> None:
        netns.run(["ip", "-n", self.bridge_ns, "link", "set", self.port(member), "up"])

    def _link_ends(self, member: str) -> list[tuple[str, str]]:
        return [(self.ns(member), self.dev(member)), (self.bridge_ns, self.port(member))]

    # -- processes --------------------------------------------------------------------------
    def spawn(self, member: str, argv: Sequence[str], *, log_path: Path | None = None, label: str = "",
              cwd: Path | None = None, env: Mapping[str, str] | None = None) -> _Process:
        """Start ``argv`` inside ``member``'s namespace; it is stopped by ``close()`` at the latest."""
        if self._closed:
            raise TopologyError("topology is closed")
        proc = _Process(list(argv), log_path, label or f"{argv[0]}@{member}", cwd=cwd, env=env,
                        prefix=self.exec_prefix(member))
        self._procs.append(proc)
        return proc

    def exec_prefix(self, member: str) -> list[str]:
        return netns.exec_prefix(self.ns(member))

    @contextlib.contextmanager
    def entered(self, member: str) -> Iterator[None]:
        """The calling thread runs inside ``member``'s namespace for the block."""
        with netns.entered(self.ns(member)):
            yield
