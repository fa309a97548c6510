"""bench.cluster's ReachWatch (the network's own floor after a heal) and the rounds counted after it."""

from __future__ import annotations

import contextlib
import socket

from bench.cluster.faults import _rounds_after
from bench.cluster.reach_watch import ReachWatch


def test_the_watch_times_the_first_connect_that_completes() -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        watch = ReachWatch(contextlib.nullcontext(), [("127.0.0.1", port)]).start()
        first, every = watch.stop()
        assert first is not None and first == every and 0 <= first < 10


def test_a_refused_address_is_never_back() -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
    watch = ReachWatch(contextlib.nullcontext(), [("127.0.0.1", port)], limit_s=0.2).start()  # nothing listens
    assert watch.stop() == (None, None)


def test_every_address_must_answer_for_the_network_to_be_back() -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv, socket.create_server(("127.0.0.1", 0)) as gone:
        ports = srv.getsockname()[1], gone.getsockname()[1]
        gone.close()  # refused from now on
        first, every = ReachWatch(contextlib.nullcontext(), [("127.0.0.1", p) for p in ports], limit_s=0.3).start().stop()
        assert first is not None and every is None


def test_rounds_after_the_network_counts_those_that_ended_after_it() -> None:
    out = {"recovered": True, "rounds_to_recover": 4,
           "after_heal": [{"s": 0.25}, {"s": 0.25}, {"s": 0.25}, {"s": 0.3}, {"s": 0.3}]}
    assert _rounds_after(out, 0.9) == 1  # rounds end at 0.25, 0.5, 0.75, 1.05: only the 4th after 0.9
    assert _rounds_after(out, 0.6) == 2
    assert _rounds_after(out, 0.0) == 4
    assert _rounds_after(out, None) is None
    assert _rounds_after({**out, "recovered": False}, 0.1) is None
