"""What the advisor predicted against what the real store served, for bench/advise/real.py (pure).

The quantity compared is the one the advisor's top-tier curve predicts (kvstore/ops/mrc.py): the
block hit ratio of the daemon's *demands*, hits / demands, where a demand is every get and every
put of a block no tier held (the client recomputed it), except the put right after a get of that
key that missed. The measured side is read from a trace of the re-run at that size, classified by
the same ``references`` code, so both sides count the same reads: a get the top tier served is a
hit, every other demand a miss.

Beside it, the share of *prompt tokens* the engines say came from the tier (their usage's
``tierkv`` split, bench/serve/figures.py tokens_by_source). The advisor does not predict tokens;
the prediction shown for them scales the predicted hit ratio by the traced run's demand tokens per
prompt token (each demand is one page of ``page_size`` tokens that the tier either served or the
engine recomputed): it assumes the engines send the daemon the same pages at every size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kvstore.ops.trace import Trace
from kvstore.store.observers import OP_GET, OP_LOOKUP


def trace_hits(trace: Trace, level: int = 0) -> tuple[int, int]:
    """(demand hits served by tier ``level`` or a tier above it, demands) of a trace, as the
    advisor counts them (kvstore/ops/mrc.py ``references``)."""
    from kvstore.ops.mrc import references

    refs = references(trace)
    recs = trace.records[trace.records["op"] != OP_LOOKUP]  # the rows ``references`` keeps, in order
    held = (recs["op"] == OP_GET) & (recs["tier"].astype(np.int64) <= level)  # MISS (255) is above any level
    return int((refs.demand & held).sum()), int(refs.demand.sum())


def share(hits: int, demands: int) -> float:
    return hits / demands if demands else 0.0


def token_share(tokens: Mapping[str, int], tier: str, prompt_tokens: int) -> float:
    """The share of prompt tokens whose KV the engines loaded from ``tier``."""
    return tokens.get(tier, 0) / prompt_tokens if prompt_tokens else 0.0


def compare(predicted: Mapping[str, float], measured: Mapping[str, dict[str, Any]], sizes: Mapping[str, int],
            tokens_per_demand_share: float, naive: float | None = None) -> dict[str, Any]:  # fmt: skip
    """``real_runs`` and ``real_max_abs_error`` from the advisor's hit ratio per size label and each
    re-run's measurement (``hits``, ``demands``, ``token_share``); ``tokens_per_demand_share``: the
    traced run's demand tokens / prompt tokens (the scale of the token prediction). ``naive``: one
    hit ratio predicted at every size (the traced one: a model that ignores the size), whose error
    shows that the figure can fail."""
    runs: dict[str, dict[str, Any]] = {}
    for label, p in predicted.items():
        m = measured[label]
        got = share(m["hits"], m["demands"])
        p_tok = p * tokens_per_demand_share
        runs[label] = {"bytes": int(sizes[label]), "predicted_share": round(p, 4), "measured_share": round(got, 4),
                       "abs_error": round(abs(p - got), 4), "hits": m["hits"], "demands": m["demands"],
                       "predicted_token_share": round(p_tok, 4), "measured_token_share": round(m["token_share"], 4),
                       "token_abs_error": round(abs(p_tok - m["token_share"]), 4)}  # fmt: skip
    errs = [r["abs_error"] for r in runs.values()]
    tok = [r["token_abs_error"] for r in runs.values()]
    out = {"real_runs": runs, "real_max_abs_error": max(errs) if errs else None,
           "real_token_max_abs_error": max(tok) if tok else None}  # fmt: skip
    if naive is not None and runs:
        out["real_naive_max_abs_error"] = round(max(abs(naive - r["measured_share"]) for r in runs.values()), 4)
    return out
