"""The driver's end of one bench/cluster/node_worker.py process: send an operation, read its answer.

``send(op, tag, count)`` writes one command line; ``receive(timeout_s)`` reads its JSON answer, or
returns ``{"error": "WorkerTimeout ..."}`` when none comes in time (the worker is then killed: its
next answer could no longer be matched to its command) or ``{"error": "WorkerGone ..."}`` when it
has ended. Sending first to every node and then receiving from each runs the nodes' operations at
the same time.
"""

from __future__ import annotations

import json
import select
import subprocess
import time


class WorkerSession:
    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.alive = True

    def send(self, op: str, tag: str, count: int) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(f"{op} {tag} {count}\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.alive = False

    def receive(self, timeout_s: float) -> dict[str, object]:
        assert self.proc.stdout is not None
        if not self.alive:
            return {"s": 0.0, "error": f"WorkerGone: exit {self.proc.poll()}"}
        t0 = time.monotonic()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not ready:
            self.alive = False
            self.proc.kill()
            return {"s": round(time.monotonic() - t0, 3), "error": f"WorkerTimeout: no answer in {timeout_s}s"}
        line = self.proc.stdout.readline()
        if not line:
            self.alive = False
            return {"s": round(time.monotonic() - t0, 3), "error": f"WorkerGone: exit {self.proc.poll()}"}
        return json.loads(line)

    def close(self) -> None:
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
