"""A flood of refused requests against a stream, with the engine's HTTP behind its gate (engine/gate.py,
a process of its own) and in the engine's own process, same run: what each refusal costs the step
loop.

    python -m bench.http_stack --out F.json [--quick] [--reps 3] [--window-s 30] [--pin]
                               [--stacks gate,c,python]

Why: bench.soak's ``dos.stop_strings`` and ``dos.prompt_16mib`` probes (16 MB bodies, each refused
413 from its Content-Length before it is read) held another tenant's stream at 1.5-1.6x its ITL p99
(issue #22's target: 1.5x). What the stream pays is the step thread waiting for the interpreter lock
while the HTTP side holds it: C HTTP (uvloop + httptools) holds it less than pure Python, the gate
not at all, but the gate is a process that needs a core of its own.

Stacks: ``gate`` (``kvengine serve --gate on``), ``c`` (``--gate off``, uvloop + httptools) and
``python`` (``--gate off`` with uvloop and httptools made to fail to import: a directory of stubs put
first on its path, so engine/cli.py ``http_stack`` falls back to asyncio + h11; the log says which).
Default: gate and c. One ``kvengine serve`` of the bundled model per stack, on one thread as the
soak's replicas; the stacks alternate in order over the reps. In each rep: a window of
bench.tenant_flood's normal client alone (streamed 32-token chat answers, in a process of its own),
then a window with the flood: ``ATTACKERS`` threads posting a 16 MB body of 16 stop strings of
1,000,000 characters, one after another (the soak's ``stop_strings``).

``--pin``: the engine's threads on CPU 0, everything else (this process's attackers, the stream's
client, the gate) on CPU 1: an engine with a core to itself, as on a host with more cores than the
engine's threads. Unpinned, on this 2-core machine, the attackers' own CPU (~0.8 of a core) and the
gate's are taken from the same cores as the engine's.

Figures per stack (median over reps, each rep's in ``runs``): ``itl_p99_ratio`` (under / alone),
``itl_p50_ratio`` (and both over every rep's gaps pooled: ``itl_p99_ratio_pooled``,
``itl_p50_ratio_pooled``), ``refusals_per_s`` (the flood's, against the stream), ``engine_cpu_us_per_refusal``
and ``gate_cpu_us_per_refusal`` (CPU seconds over the refusals of half a window of the flood against
the engine alone, before the stream's windows: while a stream decodes, its step thread takes a
whole core either way, so only an idle engine shows what the refusals cost), and ``served_on`` (from
the engine's log). Headline: ``c.itl_p99_ratio``, ``gate.itl_p99_ratio`` and
``gate_over_c_itl_p99_ratio``; with the Python stack, ``cpu_per_refusal_ratio`` (its CPU per refusal
over C's).

The faster stack gets more refusals a second from the same closed-loop attackers, so the ITL ratios
compare stacks under one attacker, not one load."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.servers import EngineServer, exit_on_sigterm
from bench.tenant_flood import KEYS, MODEL, _pct, idle_until, stream_window

ATTACKERS = 2
STACKS = ("gate", "c", "python")
DEFAULT_STACKS = ("gate", "c")
BODY = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stop": ["x" * 1_000_000] * 16}).encode()


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _no_c_http(work: Path) -> Path:
    """A directory whose ``uvloop`` and ``httptools`` fail to import, as if not installed."""
    d = work / "no_c_http"
    for name in ("uvloop", "httptools"):
        (d / name).mkdir(parents=True, exist_ok=True)
        (d / name / "__init__.py").write_text(f"raise ImportError('{name}: left out by bench.http_stack')\n")
    return d


def _refusals(base: str, until: float) -> dict[str, int]:
    codes: dict[str, int] = {}
    lock = threading.Lock()

    def worker() -> None:
        with httpx.Client(timeout=60) as h:
            while time.monotonic() < until:
                try:
                    k = str(h.post(base + "/v1/completions", content=BODY,
                                   headers={"Authorization": f"Bearer {KEYS['flood']}",
                                            "Content-Type": "application/json"}).status_code)  # fmt: skip
                except httpx.HTTPError as e:
                    k = type(e).__name__
                with lock:
                    codes[k] = codes.get(k, 0) + 1

    threads = [threading.Thread(target=worker) for _ in range(ATTACKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes


def _gate_pid(pid: int) -> int | None:
    """The engine's gate (engine/gate.py), its one child, if it has one."""
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return int(kids[0]) if kids else None


def _idle_cost(base: str, pid: int, window_s: float) -> dict[str, Any]:
    """The flood against the engine with nothing else to do: its CPU per refusal (and its gate's)."""
    gate = _gate_pid(pid)
    c0, g0 = _cpu_s(pid), _cpu_s(gate) if gate else 0.0
    codes = _refusals(base, time.monotonic() + window_s)
    cpu, gcpu = _cpu_s(pid) - c0, (_cpu_s(gate) - g0) if gate else 0.0
    n = max(codes.get("413", 0), 1)
    return {"codes": codes, "cpu_s": cpu, "us_per_refusal": 1e6 * cpu / n, "gate_us_per_refusal": 1e6 * gcpu / n}


def _window(base: str, pid: int, window_s: float, flood: bool) -> dict[str, Any]:
    def meanwhile(until: float) -> tuple[dict[str, int], float]:
        c0 = _cpu_s(pid)
        codes = _refusals(base, until) if flood else {}
        if not flood:
            idle_until(until)
        return codes, _cpu_s(pid) - c0

    gaps, _, (codes, cpu) = stream_window(base, window_s, meanwhile)
    return {"gaps": gaps, "codes": codes, "cpu_s": cpu}


def _pin_engine(pid: int) -> None:
    """``--pin``: every thread of the engine on CPU 0 (its gate, started from a bench pinned to CPU 1,
    stays there with everything else)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {0})


def run_stack(stack: str, window_s: float, work: Path, pin: bool = False) -> dict[str, Any]:
    keys = work / "keys.yaml"
    keys.write_text("".join(f"{k}: {t}\n" for t, k in KEYS.items()))
    env = {"OMP_NUM_THREADS": "1"}
    if stack == "python":
        env["PYTHONPATH"] = os.pathsep.join([str(_no_c_http(work)), os.environ.get("PYTHONPATH", "")])
    flags = ("--gate", "on" if stack == "gate" else "off")
    with EngineServer("--threads", "1", "--api-keys", str(keys), *flags, env=env,
                      log_path=work / f"engine_{stack}.log") as e:
        e.wait_ready()
        if pin:
            _pin_engine(e.proc.pid)
        idle = _idle_cost(e.base, e.proc.pid, window_s / 2)
        _window(e.base, e.proc.pid, 5, False)  # warm: radix, the first answers' shapes
        alone = _window(e.base, e.proc.pid, window_s, False)
        under = _window(e.base, e.proc.pid, window_s, True)
        served = next((line.split("/v1 (", 1)[1].rstrip(")") for line in e.log_tail(200_000).splitlines()
                       if "serving " in line and "/v1 (" in line), None)  # fmt: skip
    a, u, refused = alone["gaps"], under["gaps"], under["codes"].get("413", 0)
    return {"stack": stack, "served_on": served, "gaps_alone": len(a), "gaps_under": len(u),
            "itl_p99_alone_s": _pct(a, 0.99), "itl_p99_under_s": _pct(u, 0.99),
            "itl_p99_ratio": _pct(u, 0.99) / _pct(a, 0.99), "itl_p50_ratio": _pct(u, 0.5) / _pct(a, 0.5),
            "answers": under["codes"], "refusals_per_s": refused / window_s,
            "engine_cpu_alone_s": alone["cpu_s"], "engine_cpu_under_s": under["cpu_s"],
            "idle_refusals_per_s": idle["codes"].get("413", 0) / (window_s / 2),
            "engine_cpu_us_per_refusal": idle["us_per_refusal"], "gate_cpu_us_per_refusal": idle["gate_us_per_refusal"],
            "_gaps": (a, u)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.http_stack", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--window-s", type=float, default=30.0)
    ap.add_argument("--quick", action="store_true", help="2 reps of 15 s windows (for make bench)")
    ap.add_argument("--pin", action="store_true",
                    help="the engine on CPU 0, the rest (gate, attackers, stream client) on CPU 1: an engine with "
                         "a core of its own, as on a server with more cores than the engine's threads")
    ap.add_argument("--stacks", default=",".join(DEFAULT_STACKS),
                    help=f"which of {', '.join(STACKS)} (default %(default)s)")
    a = ap.parse_args(argv)
    exit_on_sigterm()
    reps, window_s = (2, 15.0) if a.quick else (a.reps, a.window_s)
    if a.pin:
        os.sched_setaffinity(0, {1})
    load_before = os.getloadavg()
    stacks = tuple(x for x in a.stacks.split(",") if x)
    if not stacks or any(x not in STACKS for x in stacks):
        ap.error(f"--stacks: a comma-separated list of {', '.join(STACKS)}")
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in stacks}
    gaps: dict[str, list[tuple[list[float], list[float]]]] = {s: [] for s in stacks}
    with tempfile.TemporaryDirectory(prefix="http_stack_") as tmp:
        for rep in range(reps):
            for s in stacks if rep % 2 == 0 else stacks[::-1]:
                r = run_stack(s, window_s, Path(tmp), a.pin)
                gaps[s].append(r.pop("_gaps"))
                runs[s].append(r)
                print(json.dumps(r), flush=True)
    figures = ("itl_p99_ratio", "itl_p50_ratio", "itl_p99_alone_s", "itl_p99_under_s", "refusals_per_s",
               "idle_refusals_per_s", "engine_cpu_us_per_refusal", "gate_cpu_us_per_refusal")
    doc: dict[str, Any] = {"reps": reps, "window_s": window_s, "threads": 1, "pinned": a.pin, "attackers": ATTACKERS,
                           "body_bytes": len(BODY), "runs": runs,
                           **{s: {f: statistics.median(r[f] for r in rs) for f in figures} for s, rs in runs.items()},
                           "spread": {s: {f: [min(r[f] for r in rs), max(r[f] for r in rs)] for f in figures}
                                      for s, rs in runs.items()},
                           "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg())}  # fmt: skip
    for s, gs in gaps.items():  # every rep's gaps pooled: a window's p99 alone is its ~4th-largest gap
        alone, under = [g for a_, _ in gs for g in a_], [g for _, u in gs for g in u]
        doc[s]["itl_p99_ratio_pooled"] = _pct(under, 0.99) / _pct(alone, 0.99)
        doc[s]["itl_p50_ratio_pooled"] = _pct(under, 0.5) / _pct(alone, 0.5)
    if "python" in doc and "c" in doc:
        doc["cpu_per_refusal_ratio"] = doc["python"]["engine_cpu_us_per_refusal"] / max(doc["c"]["engine_cpu_us_per_refusal"], 1e-9)
    if "gate" in doc and "c" in doc:  # the step loop's ITL p99 ratio under the flood, gate over in-process
        doc["gate_over_c_itl_p99_ratio"] = doc["gate"]["itl_p99_ratio"] / doc["c"]["itl_p99_ratio"]
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: doc[k] for k in (*stacks, "cpu_per_refusal_ratio", "gate_over_c_itl_p99_ratio") if k in doc},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
