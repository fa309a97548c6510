"""CacheBlend plumbing without a model: chunk keys, the byte-bounded store, recompute ratio, request helpers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from connector.blend import (
    BlendSpec,
    InProcessChunkStore,
    InvalidBlendRequestError,
    RecomputeRatio,
    Segment,
    build_blend_request,
    build_chat_blend_request,
    chunk_key,
    split_by_separator,
)
from connector.blend.chunk_cache import DOC, PREFIX, ChunkCache


def test_chunk_key_is_stable_across_processes():
    # load keys.py by path: no torch import, so each fresh interpreter starts in a blink
    code = ("import importlib.util as u; s = u.spec_from_file_location('k', 'connector/blend/keys.py'); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); "
            "print(m.chunk_key('fp', [1, 2, 3], 'doc', 'salt').hex())")
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.check_output([sys.executable, "-c", code], env=env, text=True).strip())
    assert outs == {chunk_key("fp", [1, 2, 3], DOC, "salt").hex()}


def test_chunk_key_namespacing():
    base = chunk_key("fp", [5, 6, 7])
    assert base == chunk_key("fp", (5, 6, 7))
    assert len({base, chunk_key("fp2", [5, 6, 7]), chunk_key("fp", [5, 6, 7], tenant_salt="t"),
                chunk_key("fp", [5, 6, 7], PREFIX), chunk_key("fp", [5, 6, 8])}) == 5


def test_store_lru_by_bytes():
    s = InProcessChunkStore(capacity_bytes=3 * 400)
    t = [torch.full((100,), float(i)) for i in range(4)]  # 400 bytes each
    for i in range(3):
        s.put(bytes([i]), t[i])
    assert s.get(bytes([0])) is not None  # touch 0: 1 is now the oldest
    s.put(bytes([3]), t[3])
    assert s.get(bytes([1])) is None and s.get(bytes([0])) is not None and s.get(bytes([3])) is not None
    assert s.used_bytes == 1200
    s.put(b"big", torch.zeros(1000))  # larger than the store: not kept, nothing evicted
    assert s.get(b"big") is None and len(s) == 3


def test_chunk_cache_computes_once():
    calls = []

    def compute(ids, kind):
        calls.append((tuple(ids), kind))
        return torch.zeros(2, 2, len(ids), 1, 4)

    cache = ChunkCache(InProcessChunkStore(), "fp", compute)
    cache.get([1, 2])
    cache.get([1, 2])
    cache.get([1, 2], tenant_salt="other")
    assert calls == [((1, 2), DOC), ((1, 2), DOC)]
    assert (cache.metrics.chunk_hits, cache.metrics.chunk_misses) == (1, 2)


def test_recompute_ratio_hides_load_time():
    assert RecomputeRatio(0.15).choose(1000, 10**6) == 0.15  # no estimates: r_min
    # 1 s to load, 2 ms per recomputed token over 1000 tokens: 500 tokens hide the load
    p = RecomputeRatio(0.15, load_time_s=lambda nbytes: nbytes / 1e6, recompute_time_s=0.002)
    assert p.choose(1000, 10**6) == pytest.approx(0.5)
    assert p.choose(1000, 10**4) == 0.15  # fast load: the floor wins
    assert p.choose(1000, 10**8) == 1.0  # slower than recomputing everything
    with pytest.raises(ValueError):
        RecomputeRatio(1.5)


class _Tok:
    bos_token_id = 1

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


def test_build_blend_request_and_separator():
    ids, spec = build_blend_request(_Tok(), "sys", ["ab", "cd"], "q?", ratio=0.3, doc_separator="|")
    assert ids == [1] + [ord(c) for c in "sysab|cd|q?"]
    assert [s.document for s in spec.segments] == [False, True, True, False]
    assert spec.ratio == 0.3 and spec.num_document_tokens == 6
    assert split_by_separator("S##d1##d2##Q", "##") == ("S", ["d1", "d2"], "Q")
    with pytest.raises(InvalidBlendRequestError):
        split_by_separator("no separators", "##")
    with pytest.raises(InvalidBlendRequestError):
        build_blend_request(_Tok(), "s", [], "q")


def test_spec_validation():
    spec = BlendSpec((Segment((1, 2), False), Segment((3,), True)), ratio=0.1)
    assert spec.prompt_ids == [1, 2, 3] and spec.num_document_tokens == 1
    with pytest.raises(InvalidBlendRequestError):
        BlendSpec((Segment((1,), True),), ratio=2.0)
    with pytest.raises(InvalidBlendRequestError):
        BlendSpec(())


def test_chat_blend_request():
    from transformers import AutoTokenizer

    from engine.model_loader import hf_model_dir

    tok = AutoTokenizer.from_pretrained(hf_model_dir(""))  # SmolLM2's, with its chat template
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who built it?"}]
    ids, spec = build_chat_blend_request(tok, msgs, ["Doc one.", "Doc two."])
    flat = tok.apply_chat_template([msgs[0], {"role": "user", "content": "Doc one.\n\nDoc two.\n\nWho built it?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert tok.decode(ids) == flat
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == flat.count(tok.bos_token)
    assert [s.document for s in spec.segments] == [False, True, True, False]
