"""ReachGate on loopback: it lets calls through while a listener answers, refuses while none does,
and lets them through again as soon as one is back (a refused connect costs no backoff)."""

from __future__ import annotations

import socket

import pytest

from tiers.reach import ReachGate, any_reachable


def _listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_any_reachable_finds_the_one_listener_among_refusing_ports() -> None:
    with _listener() as live:
        dead = ("127.0.0.1", _closed_port())
        assert any_reachable([dead, live.getsockname()], 1.0).answered
        reach = any_reachable([dead], 1.0)
        assert not reach.answered and not reach.waited  # refused at once: no timeout waited out
        assert not any_reachable([("no-such-host.invalid", 1)], 1.0).answered


def test_gate_refuses_while_nothing_answers_and_opens_when_a_server_is_back() -> None:
    port = _closed_port()
    gate = ReachGate(lambda: [("127.0.0.1", port)], timeout_s=1.0, retry_after_s=60.0)
    assert gate.refusal() is None  # nothing failed yet: no check
    gate.suspect()
    assert "refused" in (gate.refusal() or "")
    assert gate.refusal() is not None  # still suspect: checks again (fast), still refused
    with socket.socket() as back:
        back.bind(("127.0.0.1", port))
        back.listen()
        assert gate.refusal() is None  # no retry_after_s wait after a fast refusal
        assert gate.refusal() is None  # and no check any more


def test_gate_with_no_address_to_check_lets_the_call_try() -> None:
    gate = ReachGate(lambda: [], timeout_s=1.0, retry_after_s=0.5)
    gate.suspect()
    assert gate.refusal() is None


def test_gate_rejects_bad_timeouts() -> None:
    with pytest.raises(ValueError):
        ReachGate(lambda: [], timeout_s=0, retry_after_s=0.5)


def test_a_check_sees_a_link_healed_during_it_before_the_kernel_resends_its_syn(make_topology) -> None:
    """node0's packets are dropped past its port (carrier up: a switch or router failing) and the
    path comes back 0.3 s into a check of 0.9 s: the kernel would resend the first SYN only after
    1 s, past the check, so only the check's own fresh connects see the healed path within it."""
    import threading

    topo = make_topology(nodes=1, services=("svc",))
    with topo.entered("svc"):
        srv = socket.create_server((topo.addr("svc"), 0))
    with srv, topo.entered("node0"):
        assert any_reachable([srv.getsockname()], timeout_s=0.9).answered
        topo.blackhole("node0")
        assert any_reachable([srv.getsockname()], timeout_s=0.3) == (False, True)  # dropped: waited out
        healer = threading.Timer(0.3, topo.clear_rate, args=("node0",))
        healer.start()
        try:
            reach = any_reachable([srv.getsockname()], timeout_s=0.9)
        finally:
            healer.join()
        assert reach.answered, reach


def test_an_eager_check_ignores_the_wait_after_a_timed_out_one(make_topology) -> None:
    """After a check that waited out its timeout the gate refuses calls for ``retry_after_s``; the
    prober of a detached tier checks anyway (``eager``), so a heal within that wait is seen."""
    topo = make_topology(nodes=1, services=("svc",))
    with topo.entered("svc"):
        srv = socket.create_server((topo.addr("svc"), 0))
    with srv, topo.entered("node0"):
        gate = ReachGate(lambda: [srv.getsockname()], timeout_s=0.3, retry_after_s=60.0)
        assert any_reachable([srv.getsockname()], timeout_s=0.9).answered  # the neighbour known: no ARP
        topo.blackhole("node0")
        gate.suspect()
        assert "within 0.3 s" in (gate.refusal() or "")  # waited out
        topo.clear_rate("node0")
        assert "ago" in (gate.refusal() or "")  # a call is refused for retry_after_s
        assert gate.refusal(eager=True) is None  # the prober checks, and finds it back
        assert gate.refusal() is None
