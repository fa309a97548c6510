"""The connector and CacheBlend on one request: the exact prefix the daemon holds is loaded first,
and only the rest of the prompt is blended (from document chunks the daemon also holds)."""

from __future__ import annotations

from pathlib import Path

from connector.blend import BlendConfig, build_blend_request
from connector.blend.chunk_cache import InProcessChunkStore
from connector.blend.daemon_store import DaemonChunkStore
from connector.blend.frontend import add_blend_request
from connector.blend.state import BlendState, blend_state
from connector.state import kv_state
from connector.wiring import attach_cacheblend, connector_of
from engine.sampling import SamplingParams
from tests.connector.support import attach, detach, run
from tests.fixtures_engine import make_engine
from tests.fixtures_kvstore import connect, daemon

SYSTEM = "You answer questions about the island of Orvik from the documents below, briefly and exactly.\n"
DOCS = ["The lighthouse of Orvik was built in 1852 by the engineer Talia Novak, who also designed its lens. ",
        "Orvik's harbour freezes every February, and the ferries then stop running for three weeks. ",
        "Talia Novak later moved to Esterby, where she taught mathematics until she retired. "]
QUESTION = "Question: Who built the lighthouse of Orvik, and where did she move later? Answer:"


def _blend(eng, hook, spec, max_tokens: int = 6):
    rid = add_blend_request(eng, spec, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    req = eng.requests[rid]
    while not req.finished:
        eng.step()
    return req


def test_daemon_prefix_is_loaded_then_the_rest_blended(tiny, tmp_path: Path) -> None:
    ids, spec = build_blend_request(tiny.tokenizer, SYSTEM, DOCS, QUESTION, ratio=1.0)
    head_and_doc1 = len(spec.segments[0].ids) + len(spec.segments[1].ids)
    want = run(make_engine(tiny), ids).output_ids  # plain prefill: r = 1 blends must give the same tokens
    with daemon(tmp_path, "--cpu", "64MiB") as d:
        # replica A: a plain request over system + first document (its pages reach the daemon), and
        # the blend request (its document chunks reach the daemon through the chunk store)
        a = make_engine(tiny)
        attach(a, d.address, write_through=True)
        hook_a = attach_cacheblend(a, BlendConfig())
        assert a.hooks == [connector_of(a), hook_a]
        run(a, ids[: head_and_doc1 + 5])
        assert connector_of(a).flush(30)
        assert _blend(a, hook_a, spec).output_ids == want
        detach(a)
        hook_a.close()
        # replica B never saw either; attach order reversed on purpose: the wiring orders the hooks
        b = make_engine(tiny)
        client = connect(d)
        hook_b = attach_cacheblend(b, BlendConfig(), store=DaemonChunkStore(client, InProcessChunkStore()))
        conn_b = attach(b, d.address)
        try:
            assert b.hooks == [conn_b, hook_b]
            req = _blend(b, hook_b, spec)
            prefix = (head_and_doc1 + 5) // 16 * 16  # the plain request's full pages
            assert kv_state(req).decision.pages == prefix // 16
            assert conn_b.metrics.value("tierkv_connector_loaded_tokens_total", tier="cpu") == prefix
            st = blend_state(req).stats
            assert isinstance(blend_state(req), BlendState) and st.exact_prefix == prefix  # blended after it
            assert hook_b.metrics.chunk_hits == len(spec.segments) - 1 and hook_b.metrics.chunk_misses == 0
            # r = 1 recomputes every blended token: only the exact prefix loaded from the daemon is cached
            assert req.cached_tokens == prefix and req.usage.loaded == prefix and req.usage.loaded_tier == "cpu"
            assert req.output_ids == want
            # only exact KV entered the radix tree: the loaded prefix, nothing blended
            assert b.radix.match_prefix(ids, record_stats=False).num_tokens == prefix
            b.pool.allocator.check_integrity()
            b.radix.check_integrity()
        finally:
            detach(b)
            hook_b.close()
