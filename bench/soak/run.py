"""The soak: two engine replicas and one daemon (cpu + disk + s3 + redis) under streaming clients
of several tenants while a schedule SIGKILLs and restarts the daemon, the S3 server and Redis.

    python -m bench.soak --out F.json [--quick] [--fuzz-cases 10000] [--keep DIR]

What it counts (bench/soak/figures.py computes each figure; bench/run_all.py holds the targets):
every answer against a cold greedy reference (``wrong_outputs``; an exception or refusal seen by
a client is a ``client_errors``), faults injected, the growth of RSS, open files, threads and
shared-memory segments of each process after warm-up, calls to the daemon with no or a wrong token that were
not refused (``unauthenticated_accepted``: only UNAUTHENTICATED / PERMISSION_DENIED refuse),
another tenant's first request for a tenant's private prompt that reported cached tokens
(``cross_tenant_hits``), and the fuzzer's cases and crashes (bench/soak/fuzz.py, run beside the
soak against its own daemon and against replica a's API).

Tenants are credentials (bench/soak/tenancy.py), and the security probes count: cross-tenant reads
tried through every path with another tenant's credential (``cross_tenant_reads``,
bench/soak/tenant_probes.py), forged blocks written straight into Redis and S3 that an answer was
computed over (``forged_blocks_served``, bench/soak/forge.py); after the soak, with the load
stopped, DoS probes while a normal client is measured (``dos.<probe>``: bench/soak/dos.py) and the
time the daemon takes to reclaim a SIGKILLed client's shared memory (``shm_reclaim_s``,
bench/soak/shm_reclaim.py). bench/soak/security_figures.py computes those figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.run_all import BENCHES, all_met, lookup, machine_facts, verdict
from bench.servers import exit_on_sigterm
from bench.soak.cluster import Cluster
from bench.soak.dos import DosProbes, Measure
from bench.soak.figures import check_answers, cross_tenant_hits, during_outages, memory_figures
from bench.soak.fuzz import API_KEY_ENV, HTTP_SHARE
from bench.soak.load import TENANTS, Answer, Load, dos_client_prompts, workload
from bench.soak.probes import Probes
from bench.soak.security_figures import cross_tenant, forged_figures
from bench.soak.shm_reclaim import shm_reclaim
from bench.soak.watch import Watcher

MODEL = "SmolLM2-135M-Instruct"
SEED = 1  # the workload's and the fuzzers' by default (--seed)


@dataclass(frozen=True)
class Plan:
    soak_s: float  # clients run this long, faults meanwhile
    warm_s: float  # growth is measured from this long into the soak (and into each daemon's life)
    faults: tuple[tuple[float, str, float], ...]  # (seconds into the soak, target, outage seconds)
    systems: int
    questions: int
    words: int  # per system prompt
    clients: int
    max_tokens: int
    probe_every_s: float
    # each DoS probe: this long without it, then with it (bench/soak/dos.py); ~20 gaps a second, so the
    # ITL p99 of a 10 s window was its ~2nd-largest gap (1.22-1.64 over runs for the same probe)
    dos_window_s: float = 30.0
    # each DoS probe this many times (a baseline window, then the probe's): its ratio the median of theirs
    dos_pairs: int = 3
    normal_tokens: int = 24  # tokens of each answer of the DoS phase's normal client
    salts: int = 10_000
    # ~24 completions/s on the 2-core machine with the cross-tenant step bound (~45 without): 10,000 salts
    # in ~7 minutes
    salt_concurrency: int = 32
    # Each replica's KV pool: smaller than the prompts' shared prefixes (8 systems x ~250 tokens at 46 KB a
    # token in fp32 is ~90 MB), so the radix tree keeps evicting them and most answers' prefixes come back
    # from the daemon: the wrong-output check then covers the loaded path, not only the radix tree's.
    kv_memory: str = "64Mi"


# >= 64 prompts x 32 tokens checked against their cold references (#23 part 7)
QUICK = Plan(soak_s=150, warm_s=25, systems=8, questions=8, words=160, clients=6, max_tokens=32, probe_every_s=30,
             faults=((15, "daemon", 5), (35, "redis", 5), (55, "s3", 6), (80, "daemon", 5), (100, "redis", 5),
                     (118, "s3", 6)))  # fmt: skip
FULL = Plan(soak_s=900, warm_s=60, systems=8, questions=8, words=160, clients=6, max_tokens=32, probe_every_s=60,
            faults=tuple((40 + 70 * i, ("daemon", "redis", "s3")[i % 3], 8) for i in range(12)),
            dos_window_s=60.0)  # fmt: skip


# -- faults ----------------------------------------------------------------------------------------
def inject(cluster: Cluster, target: str, outage_s: float, clock: Any) -> dict[str, Any]:
    """SIGKILL ``target``, leave it down ``outage_s``, start it again on its address."""
    rec: dict[str, Any] = {"target": target, "killed_at": round(clock(), 1)}
    try:
        {"daemon": cluster.daemon.kill, "redis": cluster.redis.kill, "s3": cluster.s3.kill}[target]()
        time.sleep(outage_s)
        {"daemon": cluster.daemon.start, "redis": cluster.redis.start, "s3": cluster.s3.start}[target]()
        rec.update(back_at=round(clock(), 1), ok=True)
    except Exception as e:  # noqa: BLE001 - a fault that did not come back is reported, not raised
        rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:300])
    return rec


class Fuzzing:
    """bench.soak.fuzz in processes of their own, beside the soak: the daemon side (its own
    daemon) from the start, the HTTP side against replica a once it serves; ``result()`` merges."""

    def __init__(self, work: Path, cases: int, seed: int) -> None:
        self.work, self.seed = work, seed
        self.http_cases = int(cases * HTTP_SHARE)
        self.runs: list[tuple[subprocess.Popen[bytes], Path]] = []
        self._start("daemon", cases - self.http_cases)

    def _start(self, side: str, cases: int, *extra: str, api_key: str = "") -> None:
        out, log = self.work / f"fuzz-{side}.json", self.work / f"fuzz-{side}.log"
        env = {**os.environ, API_KEY_ENV: api_key} if api_key else None
        with open(log, "wb") as f:
            proc = subprocess.Popen([sys.executable, "-m", "bench.soak.fuzz", "--only", side, "--fuzz-cases", str(cases),
                                     "--seed", str(self.seed), "--out", str(out), *extra], stdout=f,
                                    stderr=subprocess.STDOUT, env=env)  # fmt: skip
        self.runs.append((proc, out))

    def http(self, base: str, api_key: str) -> None:
        self._start("http", self.http_cases, "--http", base, api_key=api_key)

    def result(self, timeout_s: float = 900) -> dict[str, Any]:
        merged: dict[str, Any] = {"cases": 0, "crashes": 0, "unauthenticated_accepted": 0, "outcomes": {},
                                  "crash_cases": [], "wall_s": []}  # fmt: skip
        for proc, out in self.runs:
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            doc = json.loads(out.read_text()) if out.exists() else {
                "cases": 0, "crashes": 1, "crash_cases": [{"why": f"fuzzer exited {proc.returncode}"}]}
            for k in ("cases", "crashes", "unauthenticated_accepted"):
                merged[k] += doc.get(k, 0)
            merged["outcomes"].update(doc.get("outcomes", {}))
            merged["crash_cases"] += doc.get("crash_cases", [])[:10]
            merged["wall_s"].append(doc.get("wall_s"))
        return merged


@dataclass
class Record:
    """What one soak run saw; ``figures`` turns it into the JSON."""

    prompts: int
    refs: dict[str, Answer]
    again: dict[str, Answer]  # a few references computed again on the other replica
    answers: list[Answer]
    probes: Probes
    faults: list[dict[str, Any]]
    watcher: Watcher
    fuzz: dict[str, Any]
    timings: dict[str, float]
    dos: dict[str, Any]
    reclaim: dict[str, Any]


def soak(plan: Plan, work: Path, fuzz_cases: int, seed: int) -> Record:
    prompts = workload(plan.systems, plan.questions, plan.words, seed)
    t0 = time.monotonic()
    fuzzing = Fuzzing(work, fuzz_cases, seed)
    try:
        with Cluster(work, ["--kv-memory", plan.kv_memory]) as cluster:
            cluster.start()
            timings = {"startup_s": time.monotonic() - t0}
            fuzzing.http(cluster.replicas[0].base, cluster.creds.api[TENANTS[-1]])
            watcher = Watcher(cluster.processes, queued=lambda role: cluster.daemon.queued_bytes()
                              if role == "daemon" else 0).start()  # fmt: skip
            load = Load([r.base for r in cluster.replicas], MODEL, plan.max_tokens, cluster.creds.api, clock=watcher.now)
            refs = load.references(prompts)
            n = len(load.replicas)  # prompts[::n] all went to replica 0: shifted, these go to replica 1
            again = load.references(prompts[::n][:: max(1, len(prompts) // (4 * n))][:4], shift=1)
            timings["reference_s"] = time.monotonic() - t0 - timings["startup_s"]
            warm_failed = load.warm(prompts, TENANTS)  # every tenant's prefixes in the daemon first
            timings["warm_s"] = time.monotonic() - t0 - timings["startup_s"] - timings["reference_s"]
            watcher.mark("soak")
            stop = threading.Event()
            probes = Probes(cluster, load, plan.words, seed)
            threads = [threading.Thread(target=load.run, args=(prompts, TENANTS, plan.clients, stop, seed)),
                       threading.Thread(target=probes.run, args=(stop, plan.probe_every_s))]  # fmt: skip
            for t in threads:
                t.start()
            faults, start = [], time.monotonic()
            for at, target, outage in plan.faults:
                time.sleep(max(0.0, start + at - time.monotonic()))
                faults.append(inject(cluster, target, outage, watcher.now))
            time.sleep(max(0.0, start + plan.soak_s - time.monotonic()))
            stop.set()
            for t in threads:
                t.join()
            probes.once()  # a last round after every fault
            probes.forger.close()
            timings["soak_s"] = time.monotonic() - start
            watcher.mark("end")
            fuzz = fuzzing.result()  # the HTTP side ends before the replicas stop, and before the DoS probes
            t1 = time.monotonic()
            with Measure(cluster, load, dos_client_prompts(prompts), TENANTS[0], plan.normal_tokens) as m:
                windows = DosProbes(cluster, load, MODEL, plan.dos_window_s, plan.salts, plan.salt_concurrency,
                                    pairs=plan.dos_pairs).run()
            dos = DosProbes.figures(m, windows)
            reclaim = shm_reclaim(cluster)
            timings["dos_s"] = time.monotonic() - t1
            watcher.stop()
    finally:
        for proc, _ in fuzzing.runs:
            if proc.poll() is None:
                proc.kill()
    timings["warm_failed"] = warm_failed
    return Record(len(prompts), refs, again, load.answers, probes, faults, watcher, fuzz, timings, dos, reclaim)


def figures(plan: Plan, rec: Record) -> dict[str, Any]:
    cold = {pid: a.text for pid, a in rec.refs.items() if a.error is None and a.cached == 0}
    checked = check_answers(rec.answers, {**cold, **rec.probes.reference})
    soaked = [s for s in rec.watcher.samples if s.t <= rec.watcher.marks["end"]]  # not the DoS phase's
    mem = memory_figures(soaked, rec.watcher.marks["soak"] + plan.warm_s, plan.warm_s)
    fuzz = rec.fuzz
    cross = cross_tenant(rec.probes.cross.attempts)
    forged = forged_figures(rec.probes.forger.forgeries)
    return {
        "requests": checked.requests, "client_errors": checked.client_errors, "wrong_outputs": checked.wrong_outputs,
        "checked_prompts": len(cold), "tokens_per_answer": plan.max_tokens,
        "daemon_loaded_answers": checked.daemon_loaded, "daemon_loaded_share": checked.daemon_loaded_share,
        "faults_injected": sum(1 for f in rec.faults if f["ok"]),
        "rss_growth_mb": mem["rss_growth_mb"], "fd_growth": mem["fd_growth"], "shm_growth_mb": mem["shm_growth_mb"],
        "fuzz_cases": fuzz["cases"], "fuzz_crashes": fuzz["crashes"],
        "unauthenticated_accepted": rec.probes.unauth_served + rec.probes.unauth_other + fuzz["unauthenticated_accepted"],
        "cross_tenant_hits": cross_tenant_hits(rec.probes.tenant_probes),
        "cross_tenant_reads": cross["reads"], "cross_tenant_attempts": cross["attempts"],
        "forged_blocks_served": forged["forged_blocks_served"],
        "forged_probes_exercised": forged["forged_probes_exercised"],
        "shm_reclaim_s": rec.reclaim.get("shm_reclaim_s"),
        "dos": {k: {f: v for f, v in d.items() if f != "detail"} for k, d in rec.dos.items()},
        "detail": {
            "cross_tenant": {**cross, "rounds": rec.probes.cross.rounds, "rounds_skipped": rec.probes.skipped},
            "forged": {**forged, "probes": [f._asdict() for f in rec.probes.forger.forgeries]},
            "dos": {k: d.get("detail", {}) for k, d in rec.dos.items()}, "shm_reclaim": rec.reclaim,
            "faults": rec.faults, "memory": mem, "timings_s": {k: round(v, 1) for k, v in rec.timings.items()},
            "reference": {"prompts": rec.prompts, "cold": len(cold),
                          "not_cold": sorted(p for p, a in rec.refs.items() if a.error is not None or a.cached != 0),
                          "checked_on_other_replica": len(rec.again),
                          "same_on_other_replica": sum(a.text == cold.get(p) for p, a in rec.again.items())},
            "client_error_examples": checked.errors, "wrong_output_examples": checked.wrong,
            "answers_with_cached_tokens": sum(1 for a in rec.answers if a.cached > 0),
            "answers_during_daemon_outages": during_outages(rec.answers, rec.faults, "daemon"),
            "answers_during_redis_outages": during_outages(rec.answers, rec.faults, "redis"),
            "answers_during_s3_outages": during_outages(rec.answers, rec.faults, "s3"),
            "cached_tokens": sum(max(a.cached, 0) for a in rec.answers),
            "prompt_tokens": sum(a.prompt_tokens for a in rec.answers),
            "unauthenticated_probe_calls": rec.probes.unauth_sent,
            "unauthenticated_probe_served": rec.probes.unauth_served,
            "unauthenticated_probe_not_refused": rec.probes.unauth_other,
            "unauthenticated_fuzz_calls": sum(n for k, n in fuzz["outcomes"].items() if k.endswith(" UNAUTHENTICATED")),
            "cross_tenant_probes": len(rec.probes.tenant_probes),
            "fuzz": {k: v for k, v in fuzz.items() if k != "outcomes"},
            "plan": asdict(plan),
            "samples_columns": "t_s role pid rss_anon_mb rss_mb rss_lmdb_mb rss_shmem_mb queued_mb fds threads",
            "samples": [f"{s.t:.1f} {s.role} {s.pid} {s.anon >> 20} {s.rss >> 20} {s.lmdb >> 20} {s.shmem >> 20} "
                        f"{s.queued >> 20} {s.fds} {s.threads}" for s in rec.watcher.samples],
        },
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="~5 minutes: 150 s of soak, 6 faults")
    ap.add_argument("--fuzz-cases", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--keep", default="", help="keep logs and data in this directory")
    ap.add_argument("--duration", type=float, default=0, help="seconds of soak (default: the plan's; faults past it are skipped)")
    a = ap.parse_args(argv)
    exit_on_sigterm()
    before = machine_facts()
    t0 = time.monotonic()
    plan = QUICK if a.quick else FULL
    if a.duration:
        plan = replace(plan, soak_s=a.duration, faults=tuple(f for f in plan.faults if f[0] + f[2] < a.duration))
    if a.keep:
        Path(a.keep).mkdir(parents=True, exist_ok=True)
        doc = figures(plan, soak(plan, Path(a.keep), a.fuzz_cases, a.seed))
    else:
        with tempfile.TemporaryDirectory(prefix="tierkv-soak-") as tmp:
            doc = figures(plan, soak(plan, Path(tmp), a.fuzz_cases, a.seed))
    after = machine_facts()
    doc["machine"] = {"cores": before["cores"], "loadavg_before": before["loadavg"], "loadavg_after": after["loadavg"],
                      "git_revision": before["git_revision"], "git_dirty": before["git_dirty"],
                      "wall_s": round(time.monotonic() - t0, 1), "quick": a.quick, "pid": os.getpid()}  # fmt: skip
    doc["targets"] = {f.path: verdict(lookup(doc, f.path), f) for f in BENCHES["soak"]}
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: v for k, v in doc.items() if k not in ("detail",)}, indent=1))
    return 0 if all_met(doc["targets"].values()) else 1
