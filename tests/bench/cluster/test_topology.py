"""The cluster's network: members reach each other through the bridge, tbf shapes a link, a link
taken down fails connections until it comes back, and nothing is left behind, even when building
fails half way."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

import pytest

from bench.cluster import netns
from bench.cluster.topology import Topology, TopologyConfig, TopologyError

MakeTopology = Callable[..., Topology]


def _listener(topo: Topology, member: str) -> socket.socket:
    """A listening socket on ``member``'s address (created inside its namespace, it stays there)."""
    with topo.entered(member):
        srv = socket.create_server((topo.addr(member), 0))
    srv.settimeout(5)
    return srv


def _connect(topo: Topology, member: str, to: tuple[str, int], timeout_s: float = 5.0) -> socket.socket:
    with topo.entered(member):
        return socket.create_connection(to, timeout=timeout_s)


def test_members_reach_each_other_through_the_bridge(make_topology: MakeTopology) -> None:
    topo = make_topology(nodes=2, services=("svc",))
    assert [topo.addr(m) for m in topo.members] == ["10.77.0.2", "10.77.0.3", "10.77.0.4"]
    srv = _listener(topo, "svc")
    for node in topo.nodes:
        with _connect(topo, node, srv.getsockname()) as c:
            conn, (peer, _) = srv.accept()
            assert peer == topo.addr(node)  # came over the veth, not loopback
            c.sendall(b"hello")
            assert conn.recv(5) == b"hello"
            conn.close()
    srv.close()


def test_spawn_runs_the_process_itself_inside_the_namespace(make_topology: MakeTopology) -> None:
    topo = make_topology(nodes=1, services=())
    proc = topo.spawn("node0", ["sleep", "30"])
    time.sleep(0.2)  # ip netns exec has exec'd sleep (its pid is sleep's) by the time it reads /proc
    deadline = time.monotonic() + 5
    while os.readlink(f"/proc/{proc.proc.pid}/exe").endswith("/ip") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.stat(f"/proc/{proc.proc.pid}/ns/net").st_ino == os.stat(f"{netns.NETNS_DIR}/{topo.ns('node0')}").st_ino
    topo.close()
    assert proc.proc.poll() is not None, "close() left a spawned process running"


def test_tbf_shapes_both_ends_and_clears(make_topology: MakeTopology) -> None:
    topo = make_topology(nodes=1, services=("svc",))
    topo.set_rate("node0", 16)
    for ns, dev in ((topo.ns("node0"), topo.dev("node0")), (topo.bridge_ns, topo.port("node0"))):
        shown = netns.run(["tc", "-n", ns, "qdisc", "show", "dev", dev]).stdout
        assert "tbf" in shown and "rate 16Mbit" in shown, shown
    srv = _listener(topo, "svc")
    payload = b"x" * (1 << 20)
    with _connect(topo, "node0", srv.getsockname()) as c:
        conn, _ = srv.accept()
        t0 = time.monotonic()
        sender = threading.Thread(target=c.sendall, args=(payload,))  # the reader must read meanwhile
        sender.start()
        got = 0
        while got < len(payload):
            got += len(conn.recv(1 << 16))
        elapsed = time.monotonic() - t0
        sender.join()
        conn.close()
    srv.close()
    # 1 MiB at 16 Mbit/s needs >= 0.52 s; half of that as a sanity floor (load only slows it down)
    assert elapsed > 0.26, f"1 MiB crossed a 16 Mbit/s link in {elapsed:.3f}s: not shaped"
    topo.clear_rate("node0")
    assert "tbf" not in topo.qdisc("node0")


def test_link_down_fails_connections_until_link_up(make_topology: MakeTopology) -> None:
    topo = make_topology(nodes=2, services=("svc",))
    srv = _listener(topo, "svc")
    topo.link_down("node0")
    with pytest.raises(OSError):
        _connect(topo, "node0", srv.getsockname(), timeout_s=0.5)
    with _connect(topo, "node1", srv.getsockname()):  # only node0 is cut off
        srv.accept()[0].close()
    topo.link_up("node0")
    with _connect(topo, "node0", srv.getsockname()):
        srv.accept()[0].close()
    srv.close()


def test_teardown_leaves_no_namespace(make_topology: MakeTopology) -> None:
    topo = make_topology(nodes=2, services=("redis", "s3"))
    assert len(netns.existing(topo.prefix + "-")) == 5  # bridge + 4 members
    topo.close()
    assert netns.existing(topo.prefix + "-") == []


def test_a_build_failing_half_way_leaves_nothing(make_topology: MakeTopology,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    make_topology(nodes=0, services=("probe",)).close()  # skips here if there are no namespaces
    real, calls = netns.veth, []

    def veth_failing_second(*args: str) -> None:
        calls.append(args)
        if len(calls) == 2:
            raise netns.NetnsError("injected")
        real(*args)

    monkeypatch.setattr(netns, "veth", veth_failing_second)
    prefix = "tkfail" + os.urandom(2).hex()
    with pytest.raises(netns.NetnsError, match="injected"):
        Topology(TopologyConfig(nodes=3, services=(), prefix=prefix))
    assert netns.existing(prefix + "-") == []


def test_a_prefix_in_use_is_refused_and_left_alone(make_topology: MakeTopology) -> None:
    first = make_topology(nodes=1, services=())
    with pytest.raises(TopologyError, match="exist already"):
        Topology(TopologyConfig(nodes=1, services=(), prefix=first.prefix))
    assert len(netns.existing(first.prefix + "-")) == 2  # the first run's namespaces survive


@pytest.mark.parametrize("bad", [dict(prefix="Has-Dash"), dict(prefix="x" * 11), dict(services=("node1",)),
                                 dict(subnet="10.77"), dict(nodes=0, services=())])
def test_config_is_checked(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        TopologyConfig(**bad)  # type: ignore[arg-type]


def test_no_root_means_namespaces_unavailable_not_a_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.cluster.topology import NamespacesUnavailable

    netns.unavailable.cache_clear()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    try:
        with pytest.raises(NamespacesUnavailable, match="need root"):
            Topology(TopologyConfig(nodes=1, services=()))
    finally:
        netns.unavailable.cache_clear()  # the next test asks again, as root
