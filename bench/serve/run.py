"""``python -m bench.serve``: serving under load, through the OpenAI API only.

    python -m bench.serve --out F.json [--quick] [--modes radix,daemon_cpu] [--slo 3.0]

For each mode (bench/serve/modes.py: no cache, radix only, radix + a daemon whose one tier is cpu,
disk, s3 or redis) a real ``kvengine serve`` runs the multi-round QA workload
(bench/serve/workload.py) from a load generator that speaks only the OpenAI API
(bench/serve/client.py). The engine's KV pool is sized so that the users' working set is at least
4x what it holds: most turns find their conversation evicted from the radix tree, and only a
daemon still has it. A first round, not measured, puts every user's context in the caches; then
each sweep point sends the next turn of half the users, open-loop at one QPS, and a mode leaves
the sweep at its first point whose TTFT p90 is over the SLO. All the modes' servers run at once
and take turns point by point (bench/serve/drive.py), so load from elsewhere on a shared machine
falls on every mode alike. Per mode: the figures at the first QPS (which every mode runs, so modes
compare at the same load), and the highest QPS held within the SLO. RAG (documents drawn from a
pool in varying order) runs one point per mode at the first QPS (quick: radix and daemon_s3 only).

Writes F.json (machine facts beside the figures, bench/serve/figures.py) and F.png (TTFT vs QPS).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.e2e.support import machine_facts
from bench.serve.drive import Plan, run_all
from bench.serve.figures import target_figures
from bench.serve.modes import CONNECTOR_ENV, MODES, QUICK_MODES, EngineSpec, mode_server
from bench.serve.workload import QASpec, RAGSpec, planned_qa_working_set

log = logging.getLogger("bench.serve")
PAGE = 16


@dataclass(frozen=True)
class Preset:
    qa: QASpec  # rounds are set from the sweep
    per_point: int  # QA requests per point (the users take turns)
    qps: tuple[float, ...]
    slo_s: float
    rag: RAGSpec
    rag_modes: tuple[str, ...]


QUICK = Preset(QASpec(users=16, context_tokens=640), 8, (0.5, 1, 2, 4), 3.0, RAGSpec(doc_tokens=192, requests=8),
               ("radix", "daemon_s3"))  # quick RAG: the pair the issue compares
FULL = Preset(QASpec(users=32, context_tokens=960), 16, (0.25, 0.5, 1, 2, 4, 8), 2.0,
              RAGSpec(docs=12, doc_tokens=384, requests=24), MODES)


def _plot(doc: dict, path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, m in doc["modes"].items():
        xs = [p["qps"] for p in m["sweep"]]
        ax.plot(xs, [p["ttft_p90_s"] for p in m["sweep"]], marker="o", label=f"{mode} p90")
        ax.plot(xs, [p["ttft_mean_s"] for p in m["sweep"]], linestyle=":", color=ax.lines[-1].get_color())
    ax.axhline(doc["slo_ttft_p90_s"], color="grey", linestyle="--", label="SLO (p90)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(doc["qps_sweep"], [f"{q:g}" for q in doc["qps_sweep"]])
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("TTFT (s): p90 solid, mean dotted")
    ax.set_title(f"multi-round QA, working set {doc['working_set_over_pool']:.1f}x the KV pool")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="a short run sized for a 2-core machine")
    ap.add_argument("--modes", default="", help=f"comma-separated subset of {','.join(MODES)}")
    ap.add_argument("--slo", type=float, default=None, help="TTFT p90 SLO in seconds (default: 3 quick, 2 full)")
    ap.add_argument("--qps", default="", help="comma-separated sweep (default: 0.5,1,2,4 quick)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of each engine")
    ap.add_argument("--model", default="", help="the engines' model (default: the bundled SmolLM2-135M)")
    ap.add_argument("--no-rag", action="store_true")
    ap.add_argument("--keep", default="", help="keep each mode's logs (engine, daemon) under this directory")
    ap.add_argument("--verbose-engines", action="store_true", help="debug logs in the engines (with --keep)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)  # the HTTP clients log every request at INFO
    modes = [m for m in a.modes.split(",") if m] or list(QUICK_MODES if a.quick else MODES)
    if unknown := set(modes) - set(MODES):
        ap.error(f"unknown modes {sorted(unknown)}")
    preset = QUICK if a.quick else FULL
    qps = [float(x) for x in a.qps.split(",") if x] or list(preset.qps)
    slo = a.slo if a.slo is not None else preset.slo_s
    qa = replace(preset.qa, rounds=-(-len(qps) * preset.per_point // preset.qa.users))
    rag = None if a.no_rag else preset.rag
    from transformers import AutoTokenizer

    from engine.model_loader import hf_model_dir

    tok = AutoTokenizer.from_pretrained(hf_model_dir(a.model))
    working_set, largest = planned_qa_working_set(qa, tok)
    num_pages = working_set // 4 // PAGE
    if num_pages * PAGE < largest + 2 * PAGE:
        ap.error(f"a pool of a quarter of the working set ({num_pages} pages) cannot hold one request")
    spec = EngineSpec(num_pages=num_pages, threads=a.threads, model=a.model)
    t0 = time.monotonic()
    machine = machine_facts()
    doc: dict[str, Any] = {"quick": a.quick, "slo_ttft_p90_s": slo, "qps_sweep": qps, "workload": vars(qa),
                           "requests_per_point": preset.per_point, "model": a.model or "SmolLM2-135M-Instruct",
                           "rag_workload": vars(rag) if rag else None, "engine": vars(spec),
                           "connector_env": CONNECTOR_ENV,
                           "pool_tokens": num_pages * PAGE, "working_set_tokens": working_set,
                           "working_set_over_pool": working_set / (num_pages * PAGE), "modes": {}}
    plan = Plan(qa, preset.per_point, qps, slo, rag, preset.rag_modes)
    with tempfile.TemporaryDirectory(prefix="tierkv-serve-") as tmp, contextlib.ExitStack() as stack:
        work = Path(a.keep or tmp)
        servers = {}
        for mode in modes:  # one after another: a start-up's calibration has the machine to itself
            t_mode = time.monotonic()
            servers[mode] = stack.enter_context(mode_server(mode, spec, work / mode, verbose=a.verbose_engines))
            log.info("%s: server ready in %.0fs", mode, time.monotonic() - t_mode)
        doc["modes"] = asyncio.run(run_all(servers, plan, tok))
    for mode, res in doc["modes"].items():
        log.info("%s: TTFT mean %.3fs p90 %.3fs at %g req/s, max %g req/s within the SLO", mode,
                 res["ttft_mean_s"], res["ttft_p90_s"], qps[0], res["max_qps_at_slo"])
    machine["loadavg_end"] = list(os.getloadavg())
    doc.update({"machine": machine, "wall_s": time.monotonic() - t0})
    doc["targets"] = target_figures(doc)
    if rag is not None and {"radix", "daemon_s3"} <= set(doc["modes"]):
        r, s = doc["modes"]["radix"]["rag"]["ttft_p90_s"], doc["modes"]["daemon_s3"]["rag"]["ttft_p90_s"]
        doc["rag_s3_ttft_p90_vs_radix"] = s / r if r and not math.isnan(r) else None
    out = Path(a.out)
    out.write_text(json.dumps(doc, indent=2, default=float))
    _plot(doc, out.with_suffix(".png"))
    summary = {m: {k: v[k] for k in ("ttft_mean_s", "ttft_p90_s", "itl_p99_s", "max_qps_at_slo", "finished_per_s")}
               for m, v in doc["modes"].items()}
    print(json.dumps({"modes": summary, "targets": doc["targets"], "wall_s": doc["wall_s"]}, indent=2, default=float))
    return 0
