"""CacheBlend exactness: r = 1 equals full prefill, a true-prefix chunk reuses exactly, the mask is causal."""

from __future__ import annotations

import pytest
import torch

from connector.blend import Blender, BlendSpec, Segment, build_blend_request
from connector.blend.blender import attend
from connector.blend.frontend import add_blend_request
from connector.blend.hook import BlendConfig
from connector.blend.state import blend_state
from connector.wiring import attach_cacheblend
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model import LlamaModel
from engine.sampling import SamplingParams

DOCS = ["The lighthouse of Orvik was built in 1852 by the engineer Talia Novak, who also designed its lens. ",
        "Orvik's harbour freezes every February, and the ferries then stop running for three weeks. ",
        "Talia Novak later moved to Esterby, where she taught mathematics until she retired. "]
QUESTION = "Question: Who built the lighthouse of Orvik, and where did she move later? Answer:"


@pytest.fixture(scope="module")
def tiny4(tiny4_loaded):
    loaded = tiny4_loaded
    return loaded, LlamaModel(loaded.arch, loaded.weights, torch.device("cpu"), torch.float32)


def _spec(tok, docs=DOCS, question=QUESTION):
    return build_blend_request(tok, "You answer from the documents.\n", docs, question)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Single-threaded: many small ops per step; a second thread on a busy 2-core box only waits."""
    yield


def test_r100_matches_full_prefill_smollm(smollm):
    eng = LLMEngine(EngineConfig(num_pages=128, device="cpu"), loaded=smollm)
    ids, spec = _spec(smollm.tokenizer)
    blender = Blender(eng.model, smollm.fingerprint)
    kv_full, lg_full = blender.prefill(ids)
    res = blender.blend(blender.plan(spec), ratio=1.0, collect=True)
    assert (res.logits - lg_full).abs().max() <= 1e-4
    assert torch.equal(res.kv, kv_full)  # r = 1 runs the full prefill's ops: bit-identical here
    # through the engine: plain prefill vs the blend hook at r = 1 give the same greedy tokens
    params = SamplingParams(max_tokens=4)
    plain = eng.generate([ids], params)[0].output_ids
    eng2 = LLMEngine(EngineConfig(num_pages=128, device="cpu"), loaded=smollm)
    hook = attach_cacheblend(eng2)
    spec1 = BlendSpec(spec.segments, ratio=1.0)
    rid = add_blend_request(eng2, spec1, params)
    req = eng2.requests[rid]
    while not req.finished:
        eng2.step()
    assert req.output_ids == plain
    assert blend_state(req).stats.selected == spec.num_document_tokens
    assert hook.metrics.blended_requests == 1


def test_true_prefix_chunk_reuses_exactly(tiny4):
    loaded, model = tiny4
    tok = loaded.tokenizer
    bos = loaded.arch.bos_token_id
    doc = tuple(tok(DOCS[0], add_special_tokens=False)["input_ids"])
    q = tuple(tok(QUESTION, add_special_tokens=False)["input_ids"])
    # BOS, then the document at positions 1..n: exactly where its chunk was computed
    spec = BlendSpec((Segment((bos,), False), Segment(doc, True), Segment(q, False)))
    b = Blender(model, loaded.fingerprint)
    kv_full, lg_full = b.prefill(spec.prompt_ids)
    res = b.blend(b.plan(spec), ratio=0.0, collect=True)
    assert res.num_selected == 0
    chunk = b.chunks.get(doc)  # the stored chunk, computed standalone after a BOS
    n = len(doc)
    assert torch.equal(res.kv[2:, :, 1 : 1 + n], chunk[2:])  # reused as is (delta 0: no rotation)
    assert (chunk - kv_full[:, :, 1 : 1 + n]).abs().max() <= 1e-5  # ... and it is the prefill's KV
    assert (res.logits - lg_full).abs().max() <= 1e-4


def test_causal_mask_is_exact(tiny4):
    """Recomputed tokens never see later keys: changing the last document leaves every earlier
    position's blended KV untouched (an approximate mask lets them attend to the whole chunk)."""
    loaded, model = tiny4
    tok = loaded.tokenizer
    b = Blender(model, loaded.fingerprint)
    _, spec_a = _spec(tok)
    last = list(spec_a.segments[-2].ids)
    other = [(t + 17) % 40000 for t in last]
    segs = list(spec_a.segments)
    segs[-2] = Segment(tuple(other), True)
    spec_b = BlendSpec(tuple(segs))
    cut = sum(len(s.ids) for s in spec_a.segments[:-2])
    outs = []
    for spec in (spec_a, spec_b):
        res = b.blend(b.plan(spec), ratio=0.5, select="random", collect=True,
                      generator=torch.Generator().manual_seed(5))
        outs.append(res)
    assert torch.equal(outs[0].recompute_idx, outs[1].recompute_idx)
    assert (outs[0].recompute_idx < cut).sum() > 5  # earlier documents really had tokens recomputed
    assert torch.equal(outs[0].kv[:, :, :cut], outs[1].kv[:, :, :cut])
    assert not torch.equal(outs[0].kv[:, :, cut:], outs[1].kv[:, :, cut:])


def test_partial_blend_against_naive_reference(tiny4):
    """Layer 2 recomputes only the chosen rows, each attending to the merged keys at positions
    <= its own (checked through the K/V those rows produce at layer 3)."""
    loaded, model = tiny4
    b = Blender(model, loaded.fingerprint)
    _, spec = _spec(loaded.tokenizer)
    plan = b.plan(spec)
    res = b.blend(plan, ratio=0.3, collect=True)
    idx, kv = res.recompute_idx, res.kv
    ids = torch.tensor(plan.ids)
    N = len(ids)
    h = model.embed[ids]
    pos = torch.arange(N)
    for layer in range(2):  # layers 0-1 in full
        q, k, v = model.qkv(layer, h, pos)
        h = model.finish_layer(layer, h, attend(q, k, v))
    h = h[idx]
    q, k, v = model.qkv(2, h, idx)
    K, V = kv[2, 0], kv[2, 1]
    assert torch.allclose(K[idx], k, atol=1e-5) and torch.allclose(V[idx], v, atol=1e-5)
    g = model.arch.num_heads // model.arch.num_kv_heads
    rows = []
    for r, p in enumerate(idx.tolist()):  # naive attention over keys 0..p
        Kp, Vp = K[: p + 1].repeat_interleave(g, 1), V[: p + 1].repeat_interleave(g, 1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[r], Kp) / model.arch.head_dim ** 0.5, -1)
        rows.append(torch.einsum("hn,nhd->hd", w, Vp))
    h3 = model.finish_layer(2, h, torch.stack(rows))
    _, k3, v3 = model.qkv(3, h3, idx)
    assert torch.allclose(kv[3, 0][idx], k3, atol=1e-4) and torch.allclose(kv[3, 1][idx], v3, atol=1e-4)


def test_hook_default_ratio_and_radix_stays_exact(tiny4):
    loaded, _ = tiny4
    eng = LLMEngine(EngineConfig(num_pages=64, device="cpu", page_size=16), loaded=loaded)
    hook = attach_cacheblend(eng, BlendConfig(ratio=0.2))
    ids, spec = _spec(loaded.tokenizer)
    rid = add_blend_request(eng, spec, SamplingParams(max_tokens=4))
    req = eng.requests[rid]
    while not req.finished:
        eng.step()
    st = blend_state(req).stats
    assert st.ratio == 0.2 and st.selected == round(0.2 * st.document_tokens)
    # every chunk was computed for this request (a cold store): none of its prompt's KV counts as cached;
    # the recomputed document tokens are the selection's, the rest of the chunks' tokens are fresh
    assert req.cached_tokens == 0 and req.usage.selected == st.recomputed_documents > 0
    assert req.usage.fresh == st.fresh > 0 and req.usage.computed == len(ids)
    m = hook.metrics.snapshot()
    assert m["blended_requests"] == 1 and m["chunk_misses"] == len(spec.segments) - 1
    # only the exact prefix (BOS + system prompt) may enter the radix tree
    head = len(spec.segments[0].ids)
    match = eng.radix.match_prefix(ids)
    assert match.num_tokens <= head
    # preempted mid-decode: still only the exact prefix enters the radix, and it finishes
    req = eng.requests[add_blend_request(eng, spec, SamplingParams(max_tokens=4), rid="p")]
    eng.step()
    eng.step()
    assert req.num_computed >= len(ids)
    eng.scheduler.preempt(req)
    assert eng.radix.match_prefix(ids).num_tokens <= head
    while not req.finished:
        eng.step()
    assert len(req.output_ids) == 4
    # the same documents again: every chunk is a hit
    req = eng.requests[add_blend_request(eng, spec, SamplingParams(max_tokens=2))]
    while not req.finished:
        eng.step()
    assert hook.metrics.chunk_misses == len(spec.segments) - 1  # documents were computed once
    assert hook.metrics.chunk_hits >= 2 * (len(spec.segments) - 1)


def test_hook_failure_falls_back_to_full_prefill(tiny4, monkeypatch):
    loaded, _ = tiny4
    ids, spec = _spec(loaded.tokenizer)
    plain_eng = LLMEngine(EngineConfig(num_pages=64, device="cpu"), loaded=loaded)
    plain = plain_eng.generate([ids], SamplingParams(max_tokens=3))[0].output_ids
    eng = LLMEngine(EngineConfig(num_pages=64, device="cpu"), loaded=loaded)
    hook = attach_cacheblend(eng)
    free = eng.pool.allocator.num_free()

    def boom(*a, **k):
        raise RuntimeError("simulated failure")

    monkeypatch.setattr(hook.blender, "blend", boom)
    req = eng.requests[add_blend_request(eng, spec, SamplingParams(max_tokens=3))]
    while not req.finished:
        eng.step()
    assert req.output_ids == plain and req.cache_limit is None
    assert hook.metrics.fallback_requests == 1 and hook.metrics.blended_requests == 0
    assert eng.radix.match_prefix(ids).num_tokens > 0
    # nothing leaked by the failed blend: every page is free again or owned (unlocked) by the radix tree
    assert eng.pool.allocator.num_free() + eng.radix.total_pages() == free
    assert eng.radix.evictable_pages() == eng.radix.total_pages()
    eng.radix.check_integrity()
