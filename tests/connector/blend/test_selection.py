"""Token selection for the selective recompute (connector/blend/selection.py and its use in the
blender): scores, per-chunk sink tokens within the budget, gradual per-layer filtering."""

from __future__ import annotations

import pytest
import torch

from connector.blend import Blender, InvalidBlendRequestError, build_blend_request
from connector.blend.selection import Selection, attention_deviation, chunk_sinks, kv_deviation, pick
from engine.model import LlamaModel

DOCS = ["The lighthouse of Orvik was built in 1852 by the engineer Talia Novak, who also designed its lens. ",
        "Orvik's harbour freezes every February, and the ferries then stop running for three weeks. ",
        "Talia Novak later moved to Esterby, where she taught mathematics until she retired. "]
QUESTION = "Question: Who built the lighthouse of Orvik, and where did she move later? Answer:"


@pytest.fixture(scope="module")
def tiny4(tiny4_loaded):
    loaded = tiny4_loaded
    return loaded, LlamaModel(loaded.arch, loaded.weights, torch.device("cpu"), torch.float32)


def _spec(tok):
    return build_blend_request(tok, "You answer from the documents.\n", DOCS, QUESTION)[1]


def _doc_starts(plan) -> list[int]:
    return [p.start for p in plan.pieces if bool(plan.doc_mask[p.start])]


# -- pure pieces ------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(sink_tokens=-1), dict(gradual_factor=0.5), dict(gradual_layers=-2)])
def test_selection_rejects_bad_config(kw):
    with pytest.raises(ValueError):
        Selection(**kw)


def test_gradual_counts_descend_linearly_to_the_budget():
    s = Selection(gradual_factor=2.0, gradual_layers=4)
    assert s.start_count(10, 100) == 20
    assert [s.count_after(i, 10, 20) for i in range(1, 6)] == [18, 15, 13, 10, 10]
    assert s.start_count(10, 14) == 14  # never more than the candidates
    assert s.start_count(0, 100) == 0  # r = 0 stays reuse_0
    assert Selection().start_count(10, 100) == 10 and Selection().count_after(1, 10, 10) == 10


def test_chunk_sinks():
    assert chunk_sinks([3, 10], 12, 3, torch.device("cpu")).tolist() == [3, 4, 5, 10, 11]
    assert chunk_sinks([3, 10], 12, 0, torch.device("cpu")).numel() == 0


def test_pick_puts_sinks_first_then_the_top_scores():
    cand = torch.tensor([4, 5, 6, 7, 8, 9])
    scores = torch.tensor([0.1, 9.0, 0.2, 8.0, 0.3, 0.0])
    none = torch.zeros(0, dtype=torch.long)
    assert pick(scores, cand, 2, none).tolist() == [5, 7]
    assert pick(scores, cand, 3, torch.tensor([9, 100])).tolist() == [5, 7, 9]  # a sink with score 0
    assert pick(scores, cand, 1, torch.tensor([4, 6])).tolist() == [4]  # sinks alone fill a small budget
    assert pick(scores, cand, 0, torch.tensor([4])).numel() == 0
    assert pick(scores, cand, 6, none).tolist() == cand.tolist()
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert pick(None, cand, 3, none, g1).tolist() == pick(None, cand, 3, none, g2).tolist()


def test_attention_deviation_matches_a_naive_loop():
    g = torch.Generator().manual_seed(0)
    N, Hq, Hkv, D = 9, 4, 2, 8
    k1, v1 = torch.randn(N, Hkv, D, generator=g), torch.randn(N, Hkv, D, generator=g)
    k0, v0 = k1.clone(), v1.clone()
    rows = torch.tensor([1, 3, 4])
    k0[rows] += torch.randn(3, Hkv, D, generator=g)
    v0[rows] += torch.randn(3, Hkv, D, generator=g)
    q, qpos = torch.randn(2, Hq, D, generator=g), torch.tensor([5, 6])
    got = attention_deviation(q, qpos, k1, v1, k0, v0, torch.tensor([0, 1, 3, 4, 7]))
    want = torch.zeros(5)
    for i, j in enumerate([0, 1, 3, 4, 7]):
        for m in range(2):
            for h in range(Hq):
                kv = h // (Hq // Hkv)
                vis = slice(0, int(qpos[m]) + 1)
                p1 = torch.softmax(k1[vis, kv] @ q[m, h] / D ** 0.5, 0)
                p0 = torch.softmax(k0[vis, kv] @ q[m, h] / D ** 0.5, 0)
                if j <= int(qpos[m]):
                    want[i] += (p1[j] * v1[j, kv] - p0[j] * v0[j, kv]).abs().sum()
    assert torch.allclose(got, want, atol=1e-5)
    assert got[0] < got[1] and got[0] < got[2]  # unchanged keys move only through the softmax
    assert got[4] == 0  # a key after every query contributes nothing
    assert kv_deviation(k1, k0)[rows].min() > 0 and kv_deviation(k1, k0)[0] == 0


# -- in the blender -----------------------------------------------------------------------------
def test_sinks_are_recomputed_within_the_budget(tiny4):
    loaded, model = tiny4
    b = Blender(model, loaded.fingerprint, selection=Selection(sink_tokens=3))
    plan = b.plan(_spec(loaded.tokenizer))
    sinks = {s + i for s in _doc_starts(plan) for i in range(3)}
    res = b.blend(plan, ratio=0.15, collect=True)
    assert sinks <= set(res.recompute_idx.tolist())
    doc_picked = set(res.recompute_idx.tolist()) & set(plan.doc_mask.nonzero().squeeze(1).tolist())
    assert len(doc_picked) == res.num_selected  # the sinks count within the budget
    r0 = b.blend(plan, ratio=0.0)
    assert not (set(r0.recompute_idx.tolist()) & sinks)  # r = 0 with sinks is still reuse_0


def test_random_ignores_the_selection(tiny4):
    loaded, model = tiny4
    spec = _spec(loaded.tokenizer)
    plain = Blender(model, loaded.fingerprint)
    fancy = Blender(model, loaded.fingerprint, selection=Selection(sink_tokens=4, gradual_factor=2, gradual_layers=1))
    a = plain.blend(plain.plan(spec), 0.3, "random", generator=torch.Generator().manual_seed(7))
    c = fancy.blend(fancy.plan(spec), 0.3, "random", generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.recompute_idx, c.recompute_idx) and a.layer_rows == c.layer_rows


@pytest.mark.parametrize("select", ["k", "v", "attn"])
def test_gradual_filtering_recomputes_more_first_then_the_budget(tiny4, select):
    loaded, model = tiny4
    spec = _spec(loaded.tokenizer)
    b = Blender(model, loaded.fingerprint, selection=Selection(gradual_factor=2.0, gradual_layers=1))
    plan = b.plan(spec)
    res = b.blend(plan, 0.2, select, collect=True)
    reuse = b.blend(plan, 0.0, collect=True)
    n_always = len(reuse.recompute_idx)
    n = res.num_selected
    assert len(res.recompute_idx) == n + n_always  # the budget from layer 3 on
    assert res.layer_rows == (2 * n + n_always) + (n + n_always)  # layer 2: twice the budget
    # the tokens dropped after layer 2 were recomputed there, and reused as is at layer 3
    changed2 = (res.kv[2] != reuse.kv[2]).any(0).flatten(1).any(1)
    changed3 = (res.kv[3] != reuse.kv[3]).any(0).flatten(1).any(1)
    dropped = changed2 & ~changed3
    dropped[reuse.recompute_idx] = False
    assert int(dropped.sum()) == n
    assert not changed3[plan.fixed_mask].any()


@pytest.mark.parametrize("select", ["k", "attn"])
def test_r1_stays_exact_with_every_strategy(tiny4, select):
    loaded, model = tiny4
    spec = _spec(loaded.tokenizer)
    b = Blender(model, loaded.fingerprint, selection=Selection(sink_tokens=4, gradual_factor=2, gradual_layers=2))
    kv_full, lg_full = b.prefill(spec.prompt_ids)
    res = b.blend(b.plan(spec), 1.0, select, collect=True)
    assert torch.equal(res.kv, kv_full) and torch.equal(res.logits, lg_full)


def test_unknown_select_is_refused(tiny4):
    loaded, model = tiny4
    b = Blender(model, loaded.fingerprint)
    with pytest.raises(InvalidBlendRequestError, match="select"):
        b.blend(b.plan(_spec(loaded.tokenizer)), 0.15, "q")
