"""The DoS phase's instrument: the normal client and the health sampler, in a process of their own.

    python -m bench.soak.measure SPEC.json OUT.json   (until SIGTERM; then OUT.json is written)

Why a process: the DoS probes' attackers are threads of the soak (32 HTTP clients for the salt
flood, 16 MB bodies sent in a loop); a normal client in the same interpreter shares their GIL, so
the time it stamps on each token includes waiting for the attackers' Python code — a slowdown of
the instrument, not of the server. In a process of its own the client sees only what the server
and the machine's CPUs give it (on a 2-core box the attackers still take CPU time: that part is
real).

SPEC: ``replica`` (base URL), ``model``, ``tokens`` (per answer), ``tenant`` and ``api_key``,
``prompts`` ([[pid, messages], ...]), ``daemon`` (gRPC address, health is not authenticated) and
``origin`` (the CLOCK_MONOTONIC value the soak's clock counts from: both processes stamp on the same
clock). ``OUT.ready`` appears once both are running (SIGTERM is handled from then on); OUT:
``answers`` (Answer fields) and ``health`` ((asked, answered, engine s, daemon s)).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.soak.load import Answer, Load, Prompt

HEALTH_TIMEOUT_S = 5.0
HEALTH_EVERY_S = 0.25


def run(spec: dict[str, Any], stop: threading.Event, ready: Callable[[], None] = lambda: None) -> dict[str, Any]:
    origin = float(spec["origin"])
    clock = lambda: time.monotonic() - origin  # noqa: E731 - the soak's clock, in this process
    load = Load([spec["replica"]], spec["model"], int(spec["tokens"]), {spec["tenant"]: spec["api_key"]}, clock=clock)
    prompts = [Prompt(pid, messages) for pid, messages in spec["prompts"]]
    answers: list[Answer] = []
    health: list[tuple[float, float, float, float]] = []

    def client() -> None:
        i = 0
        while not stop.is_set():
            answers.append(load.ask(prompts[i % len(prompts)], spec["tenant"], spec["replica"], keep=False))
            i += 1

    def sampler() -> None:
        with httpx.Client(timeout=HEALTH_TIMEOUT_S) as http:
            while not stop.wait(HEALTH_EVERY_S):
                t0 = clock()
                try:
                    ok = http.get(spec["replica"] + "/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                t1 = clock()
                try:
                    with grpc.insecure_channel(spec["daemon"]) as ch:
                        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S)
                    d = clock() - t1
                except grpc.RpcError:
                    d = max(clock() - t1, HEALTH_TIMEOUT_S)
                health.append((t0, clock(), t1 - t0 if ok else max(t1 - t0, HEALTH_TIMEOUT_S), d))

    threads = [threading.Thread(target=client, daemon=True), threading.Thread(target=sampler, daemon=True)]
    for t in threads:
        t.start()
    ready()
    while not stop.wait(0.5):  # a timed wait: the SIGTERM handler runs between waits
        pass
    for t in threads:
        t.join(120)
    return {"answers": [asdict(a) for a in answers], "health": health}


def answers_of(doc: dict[str, Any]) -> list[Answer]:
    return [Answer(**a) for a in doc["answers"]]


def main(argv: list[str] | None = None) -> int:
    spec_path, out_path = (argv if argv is not None else sys.argv[1:])[:2]
    with open(spec_path) as f:
        spec = json.load(f)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    doc = run(spec, stop, ready=lambda: open(out_path + ".ready", "w").close())
    with open(out_path, "w") as f:
        json.dump(doc, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
