"""DoS probes, each while a normal client is measured (bench/soak/security_figures.py ``dos_figures``).

After the fault soak, with the load stopped: a normal client streams chat answers from replica a
(its tenant's API key, ``normal_tokens`` tokens each; in a process of its own, bench/soak/measure.py,
so the attackers' threads never share its interpreter) and health is asked every 0.25 s of replica
a's ``/health`` and of the daemon (gRPC health Check), both under a 5 s timeout. For each probe,
``pairs`` times: ``window_s`` without it (the baseline), then the probe (for at least ``window_s``: a
short one's aftermath counts too), and the same client meanwhile; a gap between two tokens counts
against the probe when it overlaps the probe's window at all. A probe's ``itl_p99_ratio`` is the
median of its pairs' (bench/soak/security_figures.py ``dos_repeated``; each pair's in
``itl_p99_ratio_runs``, the pooled one beside). Why pairs: with one pair, the baseline's p99 (the
~6th-largest of ~550 gaps in 30 s) read 47-93 ms across the probes of one soak, with nothing
running but the normal client, and a probe's ratio moved more with it than with any change made to
the engine (three soaks of stop 45: the refused 16 MB bodies, a path none of those changes touched,
at 1.07 to 2.31).

- ``stop_strings``: completions with 16 stop strings of 1,000,000 characters (a 16 MB body), one
  after another: refused, 413 from its Content-Length since the body bound follows the context
  (engine/limits.py; before, read and parsed on the event loop, then refused 400);
- ``prompt_16mib``: completions whose prompt fills a body to just under 16 MiB (likewise);
- ``one_salt_flood``: completions of a few tokens, ``salt_concurrency`` at once, all under one
  salt, for a window: what such a flood costs the normal client by itself (reported, no target);
- ``salts``: 10,000 such completions, each with a ``cache_salt`` of its own, split over the pairs
  (RSS of replica a before the first and after the last; its ITL p99 is also compared with the
  one-salt flood's, pooled);
- ``stalled_puts``: 8 Put streams of a tenant that declare a block and never commit, held for the
  window, while another client's Lookup (another tenant) is asked every 0.25 s with a 1 s deadline;
- ``watch_names``: 1,000 health Watch streams, each of a name never used before (half of them 200
  bytes long, half 64 KiB), each read once and closed, split over the pairs (RSS of the daemon
  before the first and after the last).

The last two need the daemon's limits of #22 (Put streams bounded in number and time; health
without state per name): on a daemon without them they show the failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.soak.cluster import Cluster
from bench.soak.load import Answer, Load, Prompt
from bench.soak.measure import answers_of
from bench.soak.security_figures import dos_repeated, gaps_in, health_in, ratio
from bench.soak.tenant_probes import md
from bench.soak.watch import sample
from kvstore.keys import TENANT_MAGIC, tenant_tag
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc

HEALTH_TIMEOUT_S = 5.0
LOOKUP_DEADLINE_S = 1.0
# stalled Puts last: on a daemon without #22's Put limits the engines' daemon calls are still
# recovering after them, which would colour the next probe's baseline
PROBES = ("stop_strings", "prompt_16mib", "one_salt_flood", "salts", "watch_names", "stalled_puts")


class Measure:
    """The normal client and the health sampler for the whole DoS phase, on the soak's clock, in a
    process of their own (bench/soak/measure.py: sharing the attackers' interpreter would slow the
    instrument, not the server); what they saw is cut into windows by time afterwards
    (``DosProbes.figures``)."""

    def __init__(self, cluster: Cluster, load: Load, prompts: list[Prompt], tenant: str, tokens: int) -> None:
        self.cluster, self.load, self.prompts, self.tenant, self.tokens = cluster, load, prompts, tenant, tokens
        self.answers: list[Answer] = []
        self.health: list[tuple[float, float, float, float]] = []  # (asked, answered, engine s, daemon s)
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="tierkv-dos-measure-")

    def __enter__(self) -> Measure:
        spec = {"replica": self.load.replicas[0], "model": self.load.model, "tokens": self.tokens,
                "tenant": self.tenant, "api_key": self.load.api_keys[self.tenant],
                "prompts": [[p.pid, p.messages] for p in self.prompts], "daemon": self.cluster.daemon.address,
                "origin": time.monotonic() - self.load.clock()}  # fmt: skip
        d = Path(self._dir.name)
        (d / "spec.json").write_text(json.dumps(spec))
        self._proc = subprocess.Popen([sys.executable, "-m", "bench.soak.measure", str(d / "spec.json"),
                                       str(d / "out.json")], stderr=open(d / "log", "wb"))  # noqa: SIM115
        deadline = time.monotonic() + 120
        while not (d / "out.json.ready").exists():  # measuring before the first baseline starts
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self._proc.kill()
                raise RuntimeError(f"the DoS phase's normal client did not start: {(d / 'log').read_text()[-2000:]}")
            time.sleep(0.1)
        return self

    def __exit__(self, *exc: object) -> None:
        d = Path(self._dir.name)
        try:
            if self._proc is not None:
                self._proc.terminate()
                try:
                    self._proc.wait(180)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            out = d / "out.json"
            if not out.exists():
                raise RuntimeError(f"the DoS phase's normal client wrote nothing: {(d / 'log').read_text()[-2000:]}")
            doc = json.loads(out.read_text())
            self.answers = answers_of(doc)
            self.health = [tuple(h) for h in doc["health"]]  # type: ignore[misc]
        finally:
            self._dir.cleanup()


def _rss_mb(pid: int | None, n: int = 3) -> list[float]:
    out = []
    for _ in range(n):
        s = sample("x", pid, 0.0) if pid is not None else None
        if s is not None:
            out.append(s.anon / 2**20)
        time.sleep(0.5)
    return out


def _posts(base: str, key: str, body: bytes, stop: threading.Event, codes: dict[str, int]) -> None:
    """The same body, one request after another, until ``stop``; answers counted by status."""
    with httpx.Client(timeout=60) as http:
        while not stop.is_set():
            try:
                r = http.post(base + "/v1/completions", content=body,
                              headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
                k = str(r.status_code)
            except httpx.HTTPError as e:
                k = type(e).__name__
            codes[k] = codes.get(k, 0) + 1


class DosProbes:
    def __init__(self, cluster: Cluster, load: Load, model: str, window_s: float, salts: int = 10_000,
                 salt_concurrency: int = 4, watch_names: int = 1_000, stalled_puts: int = 8, pairs: int = 1) -> None:  # fmt: skip
        if pairs < 1:
            raise ValueError(f"pairs must be >= 1, got {pairs}")
        self.cluster, self.load, self.model, self.window_s, self.pairs = cluster, load, model, window_s, pairs
        self.n_salts, self.salt_concurrency, self.n_names, self.n_puts = salts, salt_concurrency, watch_names, stalled_puts
        self._part = (0, 1)  # (this pair, pairs): which share of a counted probe (salts, names) this window sends
        self.attacker = "tenant-c"
        self.key = cluster.creds.api[self.attacker]

    def run(self) -> list[dict[str, Any]]:
        """Each probe as ``pairs`` pairs of windows, a baseline window then the probe's: their times
        (the load's clock) and detail, RSS before the first probe window and after the last. A
        counted probe (salts, Watch names) sends its count once over all its pairs."""
        clock, out = self.load.clock, []
        for name in PROBES:
            w: dict[str, Any] = {"probe": name, "pairs": []}
            for k in range(self.pairs):
                pair: dict[str, Any] = {"base": [clock()]}
                time.sleep(self.window_s)
                pair["base"].append(clock())
                if k == 0:
                    w["rss_before"] = self._rss_of(name)
                stop = threading.Event()
                detail: dict[str, Any] = {}
                pair["under"] = [clock()]
                self._part = (k, self.pairs)
                getattr(self, name)(stop, detail)
                time.sleep(max(0.0, pair["under"][0] + self.window_s - clock()))  # at least a window: what it left behind
                pair["under"].append(clock())
                detail["window_s"] = round(pair["under"][1] - pair["under"][0], 1)
                w["pairs"].append({**pair, "detail": detail})
            w["rss_after"] = self._rss_of(name)
            out.append(w)
        return out

    def _share(self, n: int) -> range:
        """This pair's indices of a probe that sends ``n`` of something over all its pairs."""
        k, of = self._part
        return range(n * k // of, n * (k + 1) // of)

    @staticmethod
    def figures(measure: Measure, windows: list[dict[str, Any]]) -> dict[str, Any]:
        """Per probe: ``dos_repeated`` over the normal client's gaps and the health answers in its
        pairs of windows (the headline ratio the median of the pairs')."""
        out: dict[str, Any] = {}
        for w in windows:
            spans = [(p["base"], p["under"]) for p in w["pairs"]]
            figs = dos_repeated([(gaps_in(measure.answers, b0, b1), gaps_in(measure.answers, u0, u1, overlapping=True),
                                  health_in(((h[0], h[1], max(h[2], h[3])) for h in measure.health), u0, u1))
                                 for (b0, b1), (u0, u1) in spans], w["rss_before"], w["rss_after"])  # fmt: skip
            for i, part in ((2, "engine"), (3, "daemon")):
                seen = [s for _, (u0, u1) in spans for s in health_in(((h[0], h[1], h[i]) for h in measure.health), u0, u1)]
                figs[f"health_max_{part}_s"] = round(max(seen), 3) if seen else None
            details = [dict(p["detail"]) for p in w["pairs"]]
            met = [d.pop("lookup_deadline_met") for d in details if "lookup_deadline_met" in d]
            if met:
                figs["lookup_deadline_met"] = all(met)
            figs["normal_errors"] = sum(1 for a in measure.answers if a.error is not None
                                        and any(a.t0 < u1 and a.t1 > u0 for _, (u0, u1) in spans))  # fmt: skip
            out[w["probe"]] = {**figs, "detail": {"pairs": details}}
        if "salts" in out and "one_salt_flood" in out:  # like with like: the same flood, one salt (pooled)
            out["salts"]["itl_p99_ratio_vs_one_salt"] = ratio(out["salts"]["itl_p99_under_s"],
                                                              out["one_salt_flood"]["itl_p99_under_s"])
        return out

    def _rss_of(self, name: str) -> list[float]:
        if name == "salts":
            return _rss_mb(self.cluster.replicas[0].proc.pid)
        if name == "watch_names":
            return _rss_mb(self.cluster.daemon.pid)
        return []

    def _for_window(self, stop: threading.Event, senders: list[Callable[[], None]]) -> None:
        threads = [threading.Thread(target=f, daemon=True) for f in senders]
        for t in threads:
            t.start()
        time.sleep(self.window_s)
        stop.set()
        for t in threads:
            t.join(120)

    def stop_strings(self, stop: threading.Event, detail: dict[str, Any]) -> None:
        body = json.dumps({"model": self.model, "prompt": "Hello", "max_tokens": 4,
                           "stop": ["x" * 1_000_000] * 16}).encode()  # fmt: skip
        codes: dict[str, int] = {}
        detail.update(body_bytes=len(body), answers=codes)
        self._for_window(stop, [lambda: _posts(self.load.replicas[0], self.key, body, stop, codes)])

    def prompt_16mib(self, stop: threading.Event, detail: dict[str, Any]) -> None:
        head = json.dumps({"model": self.model, "max_tokens": 4, "prompt": ""}).encode()
        body = head[:-2] + b"a" * (16 * 2**20 - len(head) - 64) + b'"}'
        codes: dict[str, int] = {}
        detail.update(body_bytes=len(body), answers=codes)
        self._for_window(stop, [lambda: _posts(self.load.replicas[0], self.key, body, stop, codes)])

    def one_salt_flood(self, stop: threading.Event, detail: dict[str, Any]) -> None:
        """The salts probe's requests, as many at once, for one window, all under one salt: what the
        flood itself costs the normal client (no target; ``salts`` is compared with it too)."""
        self._flood(detail, lambda i: "dos-one-salt", until=time.monotonic() + self.window_s)

    def salts(self, stop: threading.Event, detail: dict[str, Any]) -> None:
        self._flood(detail, lambda i: f"dos-salt-{i:05d}-{os.getpid()}", self._share(self.n_salts))

    def _flood(self, detail: dict[str, Any], salt: Callable[[int], str], ids: range = range(10**9),
               until: float = float("inf")) -> None:  # fmt: skip
        """Completions of a few tokens, ``salt_concurrency`` at once, one for each of ``ids`` or until ``until``."""
        codes: dict[str, int] = {}
        lock = threading.Lock()
        base, sent = self.load.replicas[0], [0]
        used: set[str] = set()

        def worker(w: int) -> None:
            with httpx.Client(timeout=60) as http:
                for i in ids[w :: self.salt_concurrency]:
                    if time.monotonic() > until:
                        return
                    try:
                        r = http.post(base + "/v1/completions", headers={"Authorization": f"Bearer {self.key}"},
                                      json={"model": self.model, "prompt": f"Salt {i}.", "max_tokens": 1,
                                            "cache_salt": salt(i)})  # fmt: skip
                        k = str(r.status_code)
                    except httpx.HTTPError as e:
                        k = type(e).__name__
                    with lock:
                        codes[k] = codes.get(k, 0) + 1
                        sent[0] += 1
                        used.add(salt(i))

        with ThreadPoolExecutor(self.salt_concurrency) as pool:
            list(pool.map(worker, range(self.salt_concurrency)))
        detail.update(requests=sent[0], salts=len(used), concurrency=self.salt_concurrency, answers=codes)

    def stalled_puts(self, stop: threading.Event, detail: dict[str, Any]) -> None:
        c = self.cluster
        tag = TENANT_MAGIC + tenant_tag(self.attacker)
        token = c.creds.daemon[self.attacker]

        def stream(i: int):  # type: ignore[no-untyped-def]
            key = tag + os.urandom(16)
            yield pb.PutRequest(begin=pb.PutBegin(blocks=[pb.BlockSpec(key=key, size=1 << 20)]))
            stop.wait()  # never a chunk, never a commit

        ch = grpc.insecure_channel(c.daemon.address)
        stub = pb_grpc.KVStoreStub(ch)
        futures = [stub.Put.future(stream(i), metadata=md(token), timeout=600) for i in range(self.n_puts)]
        lookups: list[float | str] = []
        other = c.creds.daemon["tenant-a"]
        key = TENANT_MAGIC + tenant_tag("tenant-a") + bytes(16)
        deadline = time.monotonic() + self.window_s
        with grpc.insecure_channel(c.daemon.address) as lch:
            lstub = pb_grpc.KVStoreStub(lch)
            while time.monotonic() < deadline:
                t0 = time.monotonic()
                try:
                    lstub.Lookup(pb.LookupRequest(keys=[key]), metadata=md(other), timeout=LOOKUP_DEADLINE_S)
                    lookups.append(round(time.monotonic() - t0, 3))
                except grpc.RpcError as e:
                    lookups.append(e.code().name)
                time.sleep(0.25)
        stop.set()
        ends: dict[str, int] = {}
        for f in futures:
            try:
                f.result(timeout=30)
                k = "OK"
            except grpc.FutureTimeoutError:
                f.cancel()
                k = "still open"
            except grpc.RpcError as e:
                k = e.code().name
            ends[k] = ends.get(k, 0) + 1
        ch.close()
        met = [x for x in lookups if isinstance(x, float)]
        detail.update(streams=self.n_puts, put_ends=ends, lookups=len(lookups), lookups_met=len(met),
                      lookup_max_s=max(met, default=None), lookup_failures=[x for x in lookups if isinstance(x, str)][:10],
                      lookup_deadline_s=LOOKUP_DEADLINE_S)  # fmt: skip
        detail["lookup_deadline_met"] = bool(lookups) and len(met) == len(lookups)

    def watch_names(self, stop: threading.Event, detail: dict[str, Any]) -> None:
        codes: dict[str, int] = {}
        with grpc.insecure_channel(self.cluster.daemon.address, options=[("grpc.max_send_message_length", 1 << 20)]) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            names = self._share(self.n_names)
            for i in names:
                name = f"soak-watch-{i:04d}-{os.getpid()}-"
                name += "n" * ((200 if i % 2 == 0 else 64 * 1024) - len(name))
                call = stub.Watch(health_pb2.HealthCheckRequest(service=name), timeout=HEALTH_TIMEOUT_S)
                try:
                    first = next(call)
                    k = health_pb2.HealthCheckResponse.ServingStatus.Name(first.status)
                except grpc.RpcError as e:
                    k = e.code().name
                except StopIteration:
                    k = "ended"
                call.cancel()
                codes[k] = codes.get(k, 0) + 1
        detail.update(names=len(names), answers=codes)
