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
