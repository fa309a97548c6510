"""The daemon's connection limits: calls at once, dead clients and idle connections dropped.

Why: a call a client keeps open holds a worker thread; a client that died (or vanished behind a
NAT) without closing its connection held its calls for ever. Waits are bounded generously and
never asserted as latencies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest

from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from tests.fixtures_kvstore import served
from tests.kvstore.faults_support import wait_for
from tests.kvstore.limits_support import WAIT_S, StalledPuts, lookup, settings

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(240)


def test_calls_past_max_concurrent_rpcs_are_refused(tmp_path: Path) -> None:
    env = settings(workers=8, max_put_streams=4, max_concurrent_rpcs=2, put_stream_timeout_s=600, grace_s=2)
    with served(tmp_path, "--no-auth", env=env) as d:
        puts = StalledPuts(d.address)
        try:
            puts.open(b"rpc-0")
            puts.open(b"rpc-1")
            wait_for(lambda: d.servicer.put_streams.open == 2, "both Puts to run")
            with pytest.raises(grpc.RpcError) as e:
                lookup(d.address, [b"rpc-0"])
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            puts.close()


_CLIENT = """
import sys, threading
import grpc
from kvstore.proto import kvstore_pb2 as pb, kvstore_pb2_grpc as pb_grpc
stub = pb_grpc.KVStoreStub(grpc.insecure_channel(sys.argv[1]))
def messages():
    yield pb.PutRequest(begin=pb.PutBegin(blocks=[pb.BlockSpec(key=b"dead", size=4096)]))
    threading.Event().wait()
call = stub.Put.future(messages())  # kept: a future collected cancels its call
print("open", flush=True)
threading.Event().wait()
"""


def test_a_client_that_stops_answering_pings_is_dropped(tmp_path: Path) -> None:
    """A client process stopped (SIGSTOP) in the middle of a Put: its connection answers no
    keepalive ping, so the daemon drops it and the Put's worker and slot are free again."""
    env = settings(workers=2, max_put_streams=1, put_stream_timeout_s=600, keepalive_time_s=0.5,
               keepalive_timeout_s=1.0)  # fmt: skip
    with served(tmp_path, "--no-auth", env=env) as d:
        proc = subprocess.Popen([sys.executable, "-c", _CLIENT, d.address], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "open"
            wait_for(lambda: d.servicer.put_streams.open == 1, "the client's Put to run", WAIT_S)
            proc.send_signal(signal.SIGSTOP)
            wait_for(lambda: d.servicer.put_streams.open == 0, "the dead client's Put to be dropped", WAIT_S)
        finally:
            proc.kill()
            proc.wait()


def test_an_idle_connection_is_closed(tmp_path: Path) -> None:
    with served(tmp_path, "--no-auth", env=settings(max_connection_idle_s=0.3)) as d:
        ch = grpc.insecure_channel(d.address)
        states: list[grpc.ChannelConnectivity] = []
        idle_again = threading.Event()

        def seen(state: grpc.ChannelConnectivity) -> None:
            states.append(state)
            if grpc.ChannelConnectivity.READY in states and state == grpc.ChannelConnectivity.IDLE:
                idle_again.set()

        ch.subscribe(seen)
        try:
            pb_grpc.KVStoreStub(ch).Lookup(pb.LookupRequest(keys=[b"k"]), timeout=WAIT_S)
            assert idle_again.wait(WAIT_S), f"the connection stayed open: {states}"
        finally:
            ch.unsubscribe(seen)
            ch.close()
