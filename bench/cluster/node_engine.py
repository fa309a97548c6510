"""A ``kvengine serve`` replica inside a node's namespace, attached to that node's daemon.

``NodeEngine(topo, "node1", workdir, daemon_address, env={...})`` starts the engine (bench/servers.py's
process wrapper behind ``ip netns exec``, as ``Topology.spawn`` runs every process of a node) on the
node's loopback, where the node's daemon listens; ``wait_ready()`` returns once ``/health`` answers,
asked from a thread inside the namespace (the API is on the node's loopback, which ours cannot
reach). ``complete(ids, ...)`` sends one streamed ``/v1/completions`` request the same way and
returns its ``Completion``: TTFT from the send to the first chunk (the engine streams one chunk per
generated token), the greedy text, and ``prompt_tokens_details.tierkv`` (each prompt page's cache
outcome: ``loaded``, ``bypassed``, ... connector/attribution.py). ``stop()`` sends SIGTERM: staged
offloads reach the daemon within the grace, as ``kvengine serve`` promises.

Why not bench/servers.py's EngineServer: it starts the engine in our namespace and asks ``/health``
from here; a node's engine must run, and be asked, inside the node.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.cluster.topology import Topology
from bench.servers import _wait_until, free_port


class NodeEngineError(RuntimeError):
    """A node's engine answered a request with an error, or not as the API says."""


@dataclass(frozen=True)
class Completion:
    ttft_s: float
    text: str
    tierkv: dict[str, Any]  # usage.prompt_tokens_details.tierkv

    def outcome_pages(self, reason: str) -> int:
        """Prompt pages whose cache outcome is ``reason`` (``loaded``, ``bypassed``, ``read_failed``...)."""
        outcomes = self.tierkv.get("pages", {}).get("outcomes", [])
        return sum(int(o["pages"]) for o in outcomes if o["reason"] == reason)

    def outcome_tiers(self, reason: str) -> set[str]:
        outcomes = self.tierkv.get("pages", {}).get("outcomes", [])
        return {str(o["tier"]) for o in outcomes if o["reason"] == reason}


class NodeEngine:
    def __init__(self, topo: Topology, node: str, workdir: Path, daemon_address: str, *flags: str,
                 env: Mapping[str, str] | None = None, label: str = "engine", grace_s: float = 60.0) -> None:
        self.topo, self.node, self.grace_s = topo, node, grace_s
        self.port = free_port()  # free here; a node's fresh namespace has only its daemon's ports bound
        self.base = f"http://127.0.0.1:{self.port}"
        workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / f"{label}.log"
        argv = [sys.executable, "-m", "engine.cli", "serve", "--listen", f"127.0.0.1:{self.port}",
                "--kvstore", daemon_address, *flags]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self._p = topo.spawn(node, argv, log_path=self.log_path, label=f"{label}@{node}", env=full_env)

    def _healthy(self) -> bool:
        with self.topo.entered(self.node):
            return httpx.get(self.base + "/health", timeout=2).status_code == 200

    def wait_ready(self, timeout_s: float = 300.0) -> NodeEngine:
        _wait_until(self._healthy, [self._p], timeout_s, f"{self._p.label} on port {self.port}", every_s=0.5)
        return self

    def complete(self, ids: Sequence[int], max_tokens: int, salt: str, timeout_s: float = 300.0) -> Completion:
        body = {"prompt": list(ids), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "cache_salt": salt, "stream": True, "stream_options": {"include_usage": True}}
        ttft, parts, usage = None, [], None
        with self.topo.entered(self.node), httpx.Client(timeout=timeout_s) as client:  # its socket: in the node
            t0 = time.perf_counter()
            with client.stream("POST", self.base + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise NodeEngineError(f"{self._p.label}: HTTP {r.status_code}: {r.read()[:500]!r}")
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise NodeEngineError(f"{self._p.label}: {chunk['error']}")
                    if chunk.get("choices"):
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        parts.append(chunk["choices"][0]["text"])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
        if ttft is None or usage is None:
            raise NodeEngineError(f"{self._p.label}: the stream ended without a token or its usage")
        tierkv = (usage.get("prompt_tokens_details") or {}).get("tierkv") or {}
        return Completion(ttft, "".join(parts), tierkv)

    def log_tail(self, n: int = 2000) -> str:
        return self._p.log_tail(n)

    def stop(self) -> None:
        self._p.stop(self.grace_s)

    def __enter__(self) -> NodeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
