"""Usage counts as cached only prompt KV that was not computed for the request (issue 9).

``cached_tokens`` = exact radix hits + exact daemon loads + what CacheBlend reused without
recompute (its exact head and unselected document tokens, from chunks stored by earlier requests).
Recomputed tokens and chunks computed for this very request are never counted. The expected
figures here are derived from the prompt's segments, not from the hook's own bookkeeping. The
daemon part (``loaded``, its tier) is checked in tests/connector/blend/test_with_connector.py.
"""

from __future__ import annotations

import math
import re
import shutil
from dataclasses import replace

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from bench.servers import engine_server
from connector.blend import BlendConfig, build_blend_request, build_chat_blend_request
from connector.blend.frontend import add_blend_request
from connector.wiring import attach_cacheblend
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model_loader import hf_model_dir, load_model
from engine.request import PromptUsage
from engine.sampling import SamplingParams
from tests.fixtures_engine import make_engine
from tests.fixtures_model import make_tiny_llama

PS = 16
SYSTEM = "You answer questions from the documents you are given, in one short sentence.\n"
DOCS = ["The lighthouse of Orvik was built in 1852 by the engineer Talia Novak, who also designed its lens. ",
        "Orvik's harbour freezes every February, and the ferries then stop running for three weeks. ",
        "Talia Novak later moved to Esterby, where she taught mathematics until she retired. "]
NEW_DOC = "Esterby's only bridge was rebuilt in stone after the flood of 1901, at the town's own cost. "
QUESTION = "Question: Who built the lighthouse of Orvik, and where did she move later? Answer:"


@pytest.fixture(scope="module")
def tiny4_dir(tmp_path_factory):
    """4 layers: layers >= 2 exist, so blending really reuses KV (2 layers would recompute all); with
    SmolLM2's chat template, for the server's chat requests."""
    d = make_tiny_llama(tmp_path_factory.mktemp("tiny4-usage"), layers=4, seed=3)
    shutil.copy(hf_model_dir("") / "chat_template.jinja", d / "chat_template.jinja")
    return d


@pytest.fixture(scope="module")
def tiny4(tiny4_dir):
    return load_model(str(tiny4_dir))


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Single-threaded: many small ops per step; a second thread on a busy 2-core box only waits."""
    yield


def _engine(loaded) -> tuple[LLMEngine, object]:
    eng = make_engine(loaded, num_pages=96, device="cpu", page_size=PS, max_prefill_tokens=2048, num_threads=0)
    return eng, attach_cacheblend(eng, BlendConfig())


def _blend(eng, hook, spec, ratio):
    rid = add_blend_request(eng, replace(spec, ratio=ratio), SamplingParams(max_tokens=2))
    req = eng.requests[rid]
    while not req.finished:
        eng.step()
    return req


def _sums_hold(u: PromptUsage) -> None:
    assert sum(u.cached_by_source().values()) == u.cached
    assert u.cached + sum(u.computed_by_source().values()) == u.prompt_tokens
    assert min(u.computed_by_source().values()) >= 0


def _picked(ratio: float, docs: int) -> int:
    return min(docs, math.floor(ratio * docs + 0.5))  # the blender's rounding of r x document tokens


@pytest.mark.parametrize("ratio", [0.0, 0.15, 1.0])
def test_blend_usage_counts_only_kv_not_computed_for_the_request(tiny4, ratio) -> None:
    eng, hook = _engine(tiny4)
    ids, spec = build_blend_request(tiny4.tokenizer, SYSTEM, DOCS, QUESTION)
    head, docs = len(spec.segments[0].ids), spec.num_document_tokens
    cold = _blend(eng, hook, spec, ratio)
    assert cold.cached_tokens == 0  # every chunk was computed for this request
    assert cold.usage.computed == len(ids) and cold.usage.fresh + cold.usage.selected > 0
    _sums_hold(cold.usage)
    warm = _blend(eng, hook, spec, ratio)  # chunks stored now; the radix tree holds the head's full pages
    u = warm.usage
    _sums_hold(u)
    assert u.radix == head // PS * PS and u.fresh == 0
    if ratio == 1.0:  # everything blended is recomputed: only the exact prefix is cached
        assert warm.cached_tokens == u.radix and u.reused_approx == u.reused_exact == 0
        assert u.selected == docs
    else:  # the exact head and every document token not selected for recompute
        assert u.selected == _picked(ratio, docs)
        assert warm.cached_tokens == head + docs - _picked(ratio, docs)
        assert u.reused_exact == head - u.radix
        assert u.computed_by_source()["prefill"] == len(ids) - head - docs  # the question
    eng.pool.allocator.check_integrity()


def test_a_document_computed_for_this_request_is_not_cached(tiny4) -> None:
    eng, hook = _engine(tiny4)
    _, spec = build_blend_request(tiny4.tokenizer, SYSTEM, DOCS, QUESTION)
    _blend(eng, hook, spec, 0.0)
    ids, spec2 = build_blend_request(tiny4.tokenizer, SYSTEM, DOCS[:2] + [NEW_DOC], QUESTION)
    req = _blend(eng, hook, spec2, 0.0)
    head = len(spec2.segments[0].ids)
    new_doc = len(spec2.segments[3].ids)
    u = req.usage
    assert u.fresh == new_doc  # its chunk was computed now: not cached, though not "recomputed" either
    assert req.cached_tokens == head + spec2.num_document_tokens - new_doc
    assert u.computed_by_source()["blend_chunk_miss"] == new_doc
    _sums_hold(u)


def test_plain_request_usage_is_the_radix_hit(tiny4) -> None:
    eng, _ = _engine(tiny4)
    ids = build_blend_request(tiny4.tokenizer, SYSTEM, DOCS, QUESTION)[0]
    first = eng.generate([ids], SamplingParams(max_tokens=2))[0]
    again = eng.generate([ids], SamplingParams(max_tokens=2))[0]
    assert first.cached_tokens == 0 and first.usage.computed_by_source()["prefill"] == len(ids)
    assert again.cached_tokens == again.usage.radix == (len(ids) - 1) // PS * PS


def test_inconsistent_usage_is_refused() -> None:
    with pytest.raises(ValueError):
        PromptUsage(10, radix=8, loaded=4)  # more exact tokens than the prompt
    with pytest.raises(ValueError):
        PromptUsage(10, approximate=4, reused_approx=3, selected=2)  # the split exceeds the extension
    with pytest.raises(ValueError):
        PromptUsage(10, radix=-1)


# -- through the real server, with the official client ------------------------------------------


@pytest.fixture(scope="module")
def server(tiny4_dir):
    args = ["--model", str(tiny4_dir), "--served-model-name", "tiny", "--num-pages", "128", "--page-size", str(PS), "--threads", "1"]
    with engine_server(*args, timeout_s=180, grace_s=20) as engine:
        yield engine.base


def _kv_metric(base: str, outcome: str, source: str) -> float:
    text = httpx.get(base + "/metrics").text
    m = re.search(rf'^tierkv_engine_prompt_kv_tokens_total{{outcome="{outcome}",source="{source}"}} (\S+)$', text,
                  re.M)
    return float(m.group(1)) if m else 0.0


def test_server_usage_through_the_openai_client(server, tiny4_dir) -> None:
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)
    msgs = [{"role": "user", "content": "Who built the lighthouse of Orvik?"}]
    tok = AutoTokenizer.from_pretrained(tiny4_dir)
    ids, spec = build_chat_blend_request(tok, msgs, DOCS)
    head, docs = len(spec.segments[0].ids), spec.num_document_tokens

    def ask(ratio: float, stream: bool = False):
        kw = dict(model="tiny", messages=msgs, max_tokens=2, temperature=0,
                  extra_body={"documents": DOCS, "blend_ratio": ratio})
        if stream:
            chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            return chunks[-1].usage
        return client.chat.completions.create(**kw).usage

    cold = ask(1.0)
    assert cold.prompt_tokens == len(ids) and cold.prompt_tokens_details.cached_tokens == 0
    before = {s: _kv_metric(server, "cached", s) for s in ("radix", "blend_prefix", "blend_reused")}
    seen = {"radix": 0, "blend_prefix": 0, "blend_reused": 0}
    for ratio, stream in ((1.0, False), (0.15, True), (0.0, False)):
        u = ask(ratio, stream)
        ext = u.prompt_tokens_details.tierkv  # the extension; the OpenAI part parses as standard
        cached = u.prompt_tokens_details.cached_tokens
        assert sum(ext["cached"].values()) == cached
        assert cached + sum(ext["computed"].values()) == u.prompt_tokens == len(ids)
        assert ext["cached"]["radix"] == head // PS * PS and ext["daemon_tier"] is None
        if ratio == 1.0:
            assert cached == ext["cached"]["radix"]
        else:
            assert cached == head + docs - _picked(ratio, docs)
            assert ext["computed"]["blend_selected"] == _picked(ratio, docs)
        for s in seen:
            seen[s] += ext["cached"][s]
    for s, n in seen.items():  # /metrics counts the same tokens by source
        assert _kv_metric(server, "cached", s) - before[s] == n
    assert seen["blend_reused"] > 0


def test_usage_reports_the_first_admission_not_a_recompute_after_preemption(tiny) -> None:
    eng = LLMEngine(EngineConfig(num_pages=8, max_prefill_tokens=64), loaded=tiny)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 40000, (30,), generator=g).tolist() for _ in range(4)]
    reqs = eng.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    preempted = [r for r in reqs if r.num_preemptions]
    assert preempted  # re-admitted, they matched their own pages in the radix tree: still computed once
    assert all(r.cached_tokens == 0 and r.usage.computed == 30 for r in reqs)
