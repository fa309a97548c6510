"""bench.e2e's workloads: (a) multi-round chat, shared system prompt, growing histories, a KV
pool smaller than the working set; (b) long-document QA, questions round-robin. Configurations:
no cache, local radix only, radix + daemon (one per tier). Every configuration must produce the
same tokens as no cache.
"""

from __future__ import annotations

import logging
import time
import uuid

from bench.e2e import figures as fig
from bench.e2e.support import Bench, loaded_by_tier, run
from connector.wiring import detach_tierkv

log = logging.getLogger("bench.e2e")


def _chat_requests(b: Bench, users: int, turns: int, system_len: int):
    system = b.text(system_len)
    msgs = {(u, t): b.text(int(b.rng.integers(64, 128))) for u in range(users) for t in range(turns)}
    return system, msgs


def workload(b: Bench, kind: str, config: str, address: str | None, spec: dict) -> tuple[dict, list]:
    salt = f"{kind}-{config}-" + uuid.uuid4().hex[:6]
    eng = b.engine(spec["pages"])
    conn = b.attach(eng, address, load_mode="auto") if address else None
    ttfts, outputs, gen_tokens, prompt_tokens, cached = [], [], 0, 0, 0
    b.before_point(address)  # a disk configuration starts cold (bench.e2e.cold)
    t0 = time.monotonic()

    def one(ids: list[int]) -> list[int]:
        nonlocal gen_tokens, prompt_tokens, cached
        if config == "no_cache":
            eng.radix.reset()
        t, _, r = run(eng, ids, spec["max_tokens"], salt)
        ttfts.append(t)
        outputs.append(r.output_ids)
        gen_tokens += len(r.output_ids)
        prompt_tokens += len(ids)
        cached += r.cached_tokens
        return r.output_ids

    if kind == "chat":
        system, msgs = spec["system"], spec["msgs"]
        hist = {u: list(system) for u in range(spec["users"])}
        for t in range(spec["turns"]):
            for u in range(spec["users"]):
                hist[u] += msgs[(u, t)]
                hist[u] += one(hist[u])
    else:
        for i, question in enumerate(spec["questions"]):
            one(spec["docs"][i % len(spec["docs"])] + question)
    wall = time.monotonic() - t0
    by_tier = loaded_by_tier(conn) if conn else {}
    if conn:
        detach_tierkv(eng)
    loaded = sum(by_tier.values())
    row = {"config": config, "requests": len(ttfts), "ttft_p50_s": fig.percentile(ttfts, 50), "ttft_p90_s": fig.percentile(ttfts, 90),
           "throughput_tokens_per_s": gen_tokens / wall, "prompt_tokens_per_s": prompt_tokens / wall,
           "wall_s": wall, "prompt_tokens": prompt_tokens,
           "hit_tokens": {"radix": cached - loaded, **{t: v for t, v in by_tier.items() if v}}}
    log.info("workload %s %s: %s", kind, config, {k: row[k] for k in ("ttft_p50_s", "ttft_p90_s", "wall_s")})
    return row, outputs


def workloads(b: Bench, daemons: dict[str, str], quick: bool) -> tuple[dict, bool]:
    users, turns, system_len = (3, 2, 1024) if quick else (4, 4, 1024)
    system, msgs = _chat_requests(b, users, turns, system_len)
    chat_len = system_len + turns * (128 + 16)
    chat = {"users": users, "turns": turns, "system": system, "msgs": msgs, "max_tokens": 16,
            "pages": chat_len * 11 // 10 // 16}  # one conversation fits, not every history
    n_docs, doc_len, n_q = (2, 1024, 5) if quick else (4, 2048, 12)
    docs = {"docs": [b.text(doc_len) for _ in range(n_docs)], "questions": [b.text(24) for _ in range(n_q)],
            "max_tokens": 8, "pages": (doc_len + 64) * 3 // 2 // 16}  # about 1.5 documents fit
    configs = [("no_cache", None), ("radix", None)] + [(f"radix+{t}", a) for t, a in daemons.items()]
    out, identical = {}, True
    for kind, spec in (("chat", chat), ("docs", docs)):
        rows, ref = [], None
        for config, address in configs:
            row, outputs = workload(b, kind, config, address, spec)
            rows.append(row)
            ref = outputs if ref is None else ref
            row["outputs_identical_to_no_cache"] = outputs == ref
            identical &= outputs == ref
        out[kind] = {"spec": {k: v for k, v in spec.items() if k in ("users", "turns", "max_tokens", "pages")}
                     | ({"system_tokens": system_len} if kind == "chat" else {"docs": n_docs, "doc_tokens": doc_len,
                                                                             "questions": n_q}), "rows": rows}
    return out, identical
