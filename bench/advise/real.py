"""The advisor against the real store: ``real_runs`` of ``python -m bench.advise`` (issue #23).

1. A real ``kvstore serve`` (one cpu tier, large) and ``engines`` real ``kvengine serve`` replicas
   using it (small KV pools, write-through offload as bench.serve's daemon modes), driven through
   their OpenAI API by a multi-round QA workload (bench/serve/workload.py: a shared system
   prompt, a private document per conversation, a new conversation after ``max_turns``) whose
   speakers are drawn by a Zipf law (seeded). A conversation's turns alternate between engines, so
   its history is reusable from the daemon, not from the engine's own radix tree alone. The daemon
   records its access trace (kvstore/ops/trace.py) from after the engines' start-up probe to the
   end of the traffic.
2. ``advise`` (the code ``kvstore advise`` runs) on that trace, for a target of 0.9 x the hit
   ratio an unbounded tier reaches: its recommended cpu size S, and its curve's hit ratio at S/2,
   S and 2S.
3. The same requests again (fresh daemon with a cpu tier of that size, fresh engines) at each
   size, traced too: the hit ratio measured the advisor's way (bench/advise/real_share.py), the
   daemon's own counters, and the engines' prompt tokens by source. ``own_curve_share``: the curve
   of that re-run's own trace at its size, which splits the error in two: predicted - own is the
   engines sending the daemon a different stream at that size, own - measured the store not being
   the LRU the advisor models.

The requests are sent one at a time and each assistant turn is replaced in the history by a fixed
text, so every run sends the same prompts whatever the model answers; what can still differ is
what the engines send the daemon (what their radix trees hold, the cost model's load decisions,
an offload still in flight) and that is what this measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.advise.real_share import compare, share, token_share, trace_hits
from bench.serve.client import Record, client, send
from bench.serve.figures import tokens_by_source
from bench.serve.modes import CONNECTOR_ENV
from bench.serve.workload import QASpec, QAWorkload
from bench.servers import EngineServer, running_daemon

TIER = "cpu"


@dataclass(frozen=True)
class RealSpec:
    engines: int = 2
    users: int = 8
    requests: int = 32
    zipf: float = 0.8
    system_tokens: int = 96
    context_tokens: int = 224
    question_tokens: int = 16
    answer_tokens: int = 4
    max_turns: int = 4
    num_pages: int = 48  # per engine, of 16 tokens: ~2 requests' KV, so the radix tree evicts
    threads: int = 2
    traced_cpu_bytes: int = 1 << 30  # the traced run's tier: larger than the working set
    target_share: float = 0.9
    seed: int = 23


QUICK = RealSpec()
FULL = RealSpec(users=12, requests=72)


def schedule(spec: RealSpec) -> list[int]:
    """Who speaks at each request (user index), by a seeded Zipf law over the users."""
    rng = np.random.default_rng(spec.seed)
    p = 1.0 / np.arange(1, spec.users + 1) ** spec.zipf
    return [int(u) for u in rng.choice(spec.users, size=spec.requests, p=p / p.sum())]


def conversation(spec: RealSpec, tok) -> list[tuple[int, list[dict[str, str]]]]:
    """(engine index, messages) of every request, in order: the same list for every run."""
    qa = QASpec(users=spec.users, system_tokens=spec.system_tokens, context_tokens=spec.context_tokens,
                question_tokens=spec.question_tokens, answer_tokens=spec.answer_tokens, rounds=1,
                max_turns=spec.max_turns)  # fmt: skip
    wl = QAWorkload(qa, tok, seed=spec.seed)
    answer = " ".join(["okay"] * spec.answer_tokens)
    out = []
    for user in schedule(spec):
        msgs = wl.next_turn(user)
        out.append(((user + wl.turns[user]) % spec.engines, msgs))
        wl.answered(user, answer)
    return out


def _drain(address: str, settle_s: float = 1.0, max_s: float = 20.0) -> None:
    """Wait until the daemon's content stops changing (the engines' last offloads have landed)."""
    from kvstore.client.client import KVStoreClient

    last = None
    t0 = time.monotonic()
    with KVStoreClient(address, use_shm=False) as c:
        while time.monotonic() - t0 < max_s:
            s = c.stats()
            now = (s.pending_blocks, tuple(t.blocks for t in s.tiers), tuple(t.used_bytes for t in s.tiers))
            if now == last and not s.pending_blocks:
                return
            last = now
            time.sleep(settle_s)


async def _drive(ports: list[int], model: str, reqs: list[tuple[int, list[dict[str, str]]]],
                 max_tokens: int) -> list[Record]:  # fmt: skip
    apis = [client(p) for p in ports]
    out = []
    for i, (e, msgs) in enumerate(reqs):
        out.append(await send(apis[e], model, f"r{i}", msgs, max_tokens))
    return out


def run_once(spec: RealSpec, reqs: list[tuple[int, list[dict[str, str]]]], cpu_bytes: int, work: Path,
             label: str) -> dict[str, Any]:  # fmt: skip
    """One run of ``reqs`` against a fresh daemon (cpu tier of ``cpu_bytes``) and fresh engines."""
    import httpx

    from kvstore.client.client import KVStoreClient
    from kvstore.ops.mrc import lru_curve, references
    from kvstore.ops.trace import read_trace

    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with running_daemon(work / "daemon", "--cpu", str(cpu_bytes), log_path=work / "daemon.log") as address:
        flags = ["--no-blend", "--num-pages", str(spec.num_pages), "--page-size", "16", "--threads",
                 str(spec.threads), "--max-num-seqs", "4", "--kvstore", address]  # fmt: skip
        env = {"OMP_NUM_THREADS": str(spec.threads), **CONNECTOR_ENV}
        with contextlib.ExitStack() as stack:
            engines = [stack.enter_context(EngineServer(*flags, env=env, log_path=work / f"engine{i}.log", grace_s=30))
                       for i in range(spec.engines)]  # fmt: skip
            for e in engines:  # started together: each start-up (a minute of calibration on 2 cores) overlaps
                e.wait_ready(600)
            model = httpx.get(f"{engines[0].base}/v1/models", timeout=5).json()["data"][0]["id"]
            with KVStoreClient(address, use_shm=False) as c:
                c.trace_start(f"{label}.kvtrace")
            t1 = time.perf_counter()
            records = asyncio.run(_drive([e.port for e in engines], model, reqs, spec.answer_tokens))
            traffic_s = time.perf_counter() - t1
            _drain(address)
        with KVStoreClient(address, use_shm=False) as c:  # the engines are gone: nothing more is offloaded
            path, n, overwritten = c.trace_stop()
            stats = c.stats()
        trace = read_trace(path)
    errors = [r.error for r in records if r.error]
    if errors:
        raise RuntimeError(f"{label}: {len(errors)} requests failed, e.g. {errors[0]}")
    hits, demands = trace_hits(trace)
    # the curve of this run's own trace at its own size: equal to ``share`` when the store is the LRU the
    # advisor models; its gap to the traced run's curve is what the engines sent differently at this size
    own = float(lru_curve(references(trace)).hit_ratio(cpu_bytes))
    tokens = tokens_by_source(records)
    prompt = sum(r.prompt_tokens for r in records)
    top = stats.tiers[0]
    return {"label": label, "cpu_bytes": cpu_bytes, "trace": trace, "hits": hits, "demands": demands,
            "share": round(share(hits, demands), 4), "own_curve_share": round(own, 4), "records": n, "overwritten": overwritten,
            "prompt_tokens": prompt, "tokens_by_source": tokens, "token_share": token_share(tokens, TIER, prompt),
            "daemon_tier_hits": int(top.hits), "daemon_used_bytes": int(top.used_bytes),
            "traffic_s": round(traffic_s, 1), "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip


def _public(run: dict[str, Any]) -> dict[str, Any]:
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in run.items() if k != "trace"}


def real_runs(quick: bool, work: Path, log=print) -> dict[str, Any]:
    """Trace, advise, re-run at S/2, S, 2S: the ``real_runs`` figures and what they came from."""
    from transformers import AutoTokenizer

    from engine.model_loader import hf_model_dir
    from kvstore.ops.advise import advise
    from kvstore.ops.mrc import lru_curve, references

    spec = QUICK if quick else FULL
    tok = AutoTokenizer.from_pretrained(hf_model_dir(""))
    reqs = conversation(spec, tok)
    traced = run_once(spec, reqs, spec.traced_cpu_bytes, work / "traced", "traced")
    log(f"traced run: {_public(traced)}")
    trace = traced.pop("trace")
    curve = lru_curve(references(trace))  # the advisor's top-tier curve (exact: the trace is small)
    target = round(spec.target_share * curve.max_hit_ratio, 3)
    advice = advise(trace, target)
    s = advice.tiers[0].recommended_bytes
    if s is None:
        raise RuntimeError(f"the advisor found no size for target {target} (max {curve.max_hit_ratio})")
    sizes = {"half": s // 2, "recommended": s, "double": 2 * s}
    predicted = {k: float(curve.hit_ratio(v)) for k, v in sizes.items()}
    measured = {}
    for label, c in sizes.items():
        run = run_once(spec, reqs, c, work / label, label)
        run.pop("trace")
        measured[label] = run
        log(f"{label} ({c} B): predicted {predicted[label]:.3f}, measured {run['share']:.3f}; {_public(run)}")
    demand_tokens = traced["demands"] * 16
    scale = demand_tokens / traced["prompt_tokens"] if traced["prompt_tokens"] else 0.0
    out = compare(predicted, measured, sizes, scale, naive=traced["share"])
    out["real"] = {
        "spec": asdict(spec),
        "target": target,
        "recommended_bytes": s,
        "advisor_hit_ratio_recommended": advice.tiers[0].hit_ratio_recommended,
        "max_hit_ratio": advice.max_hit_ratio,
        # the traced run itself: the curve at the traced size against what that run served (a self-check
        # of the trace and the curve, not a prediction)
        "traced_self_check": {"predicted_share": round(float(curve.hit_ratio(spec.traced_cpu_bytes)), 4),
                              "measured_share": traced["share"]},
        # the run at 2S holds everything the traced run held (daemon_used_bytes below its size) when this is
        # not None: the same configuration twice, so its gap is the run-to-run noise of the measurement
        "repeat_abs_gap": (round(abs(traced["share"] - measured["double"]["share"]), 4)
                           if traced["daemon_used_bytes"] <= sizes["double"] else None),
        "traced": _public(traced),
        "runs": {k: _public(v) for k, v in measured.items()},
    }
    return out
