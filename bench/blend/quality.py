"""One CacheBlend quality pass: every case through full prefill and every method, greedy 32-token
continuations decoded in lockstep, per-method per-case figures (bench/blend/figures.py)."""

from __future__ import annotations

import statistics

import torch

from bench.blend.data import ANSWER_VOCAB
from bench.blend.figures import answer_agreement, answer_terms, lcs_f1, trim_at_eos
from connector.blend import Blender, build_blend_request
from connector.blend.blender import CHECK_LAYER
from engine.model import LlamaModel

GEN = 32
Method = tuple[Blender, float, str]  # (blender, ratio, select)


@torch.inference_mode()
def greedy_lockstep(model: LlamaModel, caches: list[torch.Tensor], first_logits: list[torch.Tensor],
                    n: int = GEN) -> list[list[int]]:
    """Greedy-decode n tokens for B prompts at once, each over its own KV [L, 2, N, H, D]."""
    a, dev = model.arch, model.device
    B, N = len(caches), caches[0].shape[2]
    kv = torch.zeros(a.num_layers, 2, B, a.num_kv_heads, N + n, a.head_dim, dtype=model.dtype, device=dev)
    for i, c in enumerate(caches):
        kv[:, :, i, :, :N] = c.transpose(2, 3)
    toks = [[int(lg.argmax())] for lg in first_logits]
    for step in range(n - 1):
        p = N + step
        ids = torch.tensor([t[-1] for t in toks], device=dev)
        h = model.embed[ids]
        pos = torch.full((B,), p, device=dev)
        for layer in range(a.num_layers):
            q, k, v = model.qkv(layer, h, pos)
            kv[layer, 0, :, :, p], kv[layer, 1, :, :, p] = k, v
            K, V = kv[layer, 0, :, :, : p + 1], kv[layer, 1, :, :, : p + 1]
            o = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], K, V, enable_gqa=True)[:, :, 0]
            h = model.finish_layer(layer, h, o)
        for t, lg in zip(toks, model.logits(h), strict=True):
            t.append(int(lg.argmax()))
    return toks


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    return float((lp.exp() * (lp - lq)).sum())


def match_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


FIELDS = ("first", "exact", "match", "kl", "share", "compute", "f1", "agree")


def summarize(stats: dict) -> dict:
    mean = statistics.fmean
    return {name: {"first_token_agreement": mean(s["first"]), "exact32": mean(s["exact"]),
                   "mean_match_len": mean(s["match"]), "kl": mean(s["kl"]), "kl_p50": statistics.median(s["kl"]),
                   "recomputed_share": mean(s["share"]), "compute_share": mean(s["compute"]),
                   "continuation_f1": mean(s["f1"]), "answer_agreement": mean(s["agree"])}
            for name, s in stats.items() if s["kl"]}


def eval_case(ref: Blender, tok, case, methods: dict[str, Method], gen: torch.Generator) -> tuple[dict, dict]:
    """Full prefill and every method on one case: per-method figures, and facts about the reference."""
    ids, spec = build_blend_request(tok, case.system, case.documents, case.question)
    kv_full, lg_full = ref.prefill(ids)
    caches, logits, rows = [kv_full], [lg_full], {}
    L = ref.model.arch.num_layers - CHECK_LAYER - 1
    for name, (b, r, sel) in methods.items():
        res = b.blend(b.plan(spec), r, sel, collect=True, generator=gen)
        caches.append(res.kv)
        logits.append(res.logits)
        rows[name] = (kl(lg_full, res.logits), len(res.recompute_idx) / len(ids),
                      res.layer_rows / (L * len(ids)) if L > 0 else 1.0)
    outs = greedy_lockstep(ref.model, caches, logits)
    eos = ref.model.arch.eos_token_ids
    ref_toks = trim_at_eos(outs[0], eos)
    ref_text = tok.decode(ref_toks)
    out: dict[str, dict[str, float]] = {}
    for j, name in enumerate(methods, start=1):
        toks = trim_at_eos(outs[j], eos)
        ml = match_len(outs[0], outs[j])
        k, share, compute = rows[name]
        out[name] = {"first": float(outs[0][0] == outs[j][0]), "exact": float(ml == GEN), "match": float(ml),
                     "kl": k, "share": share, "compute": compute, "f1": lcs_f1(ref_toks, toks),
                     "agree": float(answer_agreement(ref_text, tok.decode(toks), ANSWER_VOCAB))}
    facts = {"tokens": len(ids), "ref_terms": len(answer_terms(ref_text, ANSWER_VOCAB)), "outs": outs,
             "logits": logits}
    return out, facts


def run_quality(methods: dict[str, Method], tok, cases, log, progress=None) -> tuple[dict, dict]:
    """Every case through full prefill and every method; per-method, per-case figures (FIELDS)."""
    stats: dict[str, dict[str, list[float]]] = {m: {f: [] for f in FIELDS} for m in methods}
    ref = next(iter(methods.values()))[0]
    state = {"r100_ok": True, "r100_diff": 0.0, "ref_terms": []}
    gen = torch.Generator().manual_seed(0)
    for i, c in enumerate(cases):
        per, facts = eval_case(ref, tok, c, methods, gen)
        for name, figs in per.items():
            for f in FIELDS:
                stats[name][f].append(figs[f])
        state["ref_terms"].append(float(facts["ref_terms"] > 0))
        if "blend_1.0" in methods:
            j100 = list(methods).index("blend_1.0") + 1
            d = float((facts["logits"][j100] - facts["logits"][0]).abs().max())
            state["r100_diff"] = max(state["r100_diff"], d)
            state["r100_ok"] &= facts["outs"][j100] == facts["outs"][0] and d <= 1e-4
        log.info("case %d/%d %s %d tokens: f1 %s", i + 1, len(cases), c.kind, facts["tokens"],
                 " ".join(f"{n} {per[n]['f1']:.2f}" for n in methods))
        if progress is not None:
            progress(stats, state, i + 1)
    return stats, state
