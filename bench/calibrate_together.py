"""Engines started together on one host: what their start-up prefill calibration fits, and how long
they take to be ready, with and without the wait for quiet cores (connector/calibrate.py).

    python -m bench.calibrate_together --out F.json [--engines 3] [--threads 2] [--repeats 3] [--quick]

One kvstore daemon; one kvengine (the bundled SmolLM2-135M, ``--threads``) started alone, the
reference; then ``--engines`` of them started at the same moment with
``TIERKV_CONNECTOR_CALIBRATE_QUIET_WAIT_S=0`` and ``TIERKV_ENGINE_CPU_GEMM_QUIET_WAIT_S=0``
(``together_no_wait``: both start-up timings as they were) and with the default waits
(``together``). Each engine's fit (a, b, c) is read from its log line, and
priced as the predicted seconds of a 256-token and a 1,024-token prefill. Figures, per phase: each
engine's ``predict_256_over_alone`` (its prediction / the lone engine's), ``ready_s`` (start to
/health answering, the last of them), ``waited_s`` and ``contended_runs`` (from the log line).
``f_linear_engines``: engines whose start-up choice of form for small steps (engine/cpu_gemm.py,
``linear_rows`` per engine) was F.linear throughout, over all runs: a lone engine here chooses
the mm form, which halves a decode step. ``max_predict_ratio``: the largest |log| distance from 1 of an engine's ratio, back as a ratio
(1.0: every engine fitted what the lone one did). Repeated ``--repeats`` times (2 with ``--quick``; each with its own
lone reference): min/median/max per phase, every run under ``runs``. ``together_no_wait`` never
reads the cores, so its ``waited_s`` and ``contended_runs`` are 0 by construction. Targets: none
set by an issue; the lone engine is the reference a user would compare with.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.servers import EngineServer, exit_on_sigterm, running_daemon

FIT = re.compile(r"prefill model a=([\d.e+-]+)s b=([\d.e+-]+)ms/token c=([\d.e+-]+)s/token\^2 from \d+ prefills "
                 r"in ([\d.]+)s(?: \(([\d.]+)s of it waiting for quiet cores, (\d+) timed runs on shared cores\))?")


LINEAR = re.compile(r"linear layers: (?:.*F\.linear past (\d+) \(|F\.linear \()")


def _linear_rows(log: str) -> int:
    """engine/cpu_gemm.py's start-up choice: a form other than F.linear up to this many rows (0: F.linear
    throughout)."""
    m = LINEAR.search(log)
    if m is None:
        raise RuntimeError(f"no linear layers line in the engine's log:\n{log[-2000:]}")
    return int(m[1] or 0)


def _fit(log: str) -> dict[str, float]:
    m = FIT.search(log)
    if m is None:
        raise RuntimeError(f"no prefill model line in the engine's log:\n{log[-2000:]}")
    a, b_ms, c = float(m[1]), float(m[2]), float(m[3])
    b = b_ms / 1e3

    def predict(n: int) -> float:
        return a + b * n + c * n * n / 2

    return {"a": a, "b": b, "c": c, "calibrate_s": float(m[4]), "waited_s": float(m[5] or 0),
            "contended_runs": int(m[6] or 0), "predict_256_s": predict(256), "predict_1024_s": predict(1024)}


def _start(n: int, address: str, threads: int, work: Path, tag: str, wait_s: float | None) -> dict[str, Any]:
    env = {"OMP_NUM_THREADS": str(threads)}
    if wait_s is not None:  # both start-up timings: the prefill model's and the small-step form's
        env["TIERKV_CONNECTOR_CALIBRATE_QUIET_WAIT_S"] = str(wait_s)
        env["TIERKV_ENGINE_CPU_GEMM_QUIET_WAIT_S"] = str(wait_s)
    t0 = time.monotonic()
    servers = [EngineServer("--kvstore", address, "--threads", str(threads), "--num-pages", "256", env=env,
                            log_path=work / f"{tag}-{i}.log", label=f"{tag}-{i}") for i in range(n)]
    try:
        ready = []
        for s in servers:
            s.wait_ready(600)
            ready.append(time.monotonic() - t0)
        logs = [(work / f"{tag}-{i}.log").read_text() for i in range(n)]
        fits = [{**_fit(text), "linear_rows": _linear_rows(text)} for text in logs]
    finally:
        for s in servers:
            s.stop()
    return {"engines": [{**f, "ready_s": round(r, 1)} for f, r in zip(fits, ready, strict=True)],
            "ready_s": round(max(ready), 1), "f_linear_engines": sum(f["linear_rows"] == 0 for f in fits)}


def _ratios(phase: dict[str, Any], alone: dict[str, float]) -> None:
    for e in phase["engines"]:
        e["predict_256_over_alone"] = round(e["predict_256_s"] / alone["predict_256_s"], 2)
        e["predict_1024_over_alone"] = round(e["predict_1024_s"] / alone["predict_1024_s"], 2)
    worst = max(abs(math.log(e[k])) for e in phase["engines"]
                for k in ("predict_256_over_alone", "predict_1024_over_alone"))
    phase["max_predict_ratio"] = round(math.exp(worst), 2)


def run_once(engines: int, threads: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tierkv-calib-") as tmp:
        work = Path(tmp)
        with running_daemon(work / "cache", "--cpu", "512MiB", log_path=work / "daemon.log") as address:
            alone = _start(1, address, threads, work, "alone", None)
            no_wait = _start(engines, address, threads, work, "together_no_wait", 0.0)
            together = _start(engines, address, threads, work, "together", None)
    ref = alone["engines"][0]
    for phase in (no_wait, together):
        _ratios(phase, ref)
    return {"alone": alone, "together_no_wait": no_wait, "together": together}


def _spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def run(engines: int, threads: int, repeats: int) -> dict[str, Any]:
    runs = [run_once(engines, threads) for _ in range(repeats)]
    out: dict[str, Any] = {"engines": engines, "threads": threads, "cpus": os.cpu_count(), "repeats": repeats}
    for phase in ("together_no_wait", "together"):
        out[phase] = {k: _spread([r[phase][k] for r in runs]) for k in ("max_predict_ratio", "ready_s")}
        out[phase]["f_linear_engines"] = sum(r[phase]["f_linear_engines"] for r in runs)
    out["alone"] = {"ready_s": _spread([r["alone"]["ready_s"] for r in runs]),
                    "f_linear_engines": sum(r["alone"]["f_linear_engines"] for r in runs)}
    return {**out, "runs": runs, "loadavg_end": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 repeats (make bench)")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats = 2
    if args.engines < 2 or args.threads < 1 or args.repeats < 1:
        ap.error("--engines must be >= 2, --threads and --repeats >= 1")
    doc = {"loadavg_start": os.getloadavg()[0], **run(args.engines, args.threads, args.repeats)}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    for k in ("together_no_wait", "together", "alone"):
        print(f"{k}: {doc[k]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
