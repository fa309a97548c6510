"""Tenants are isolated through every tier, for prefix pages and CacheBlend chunks alike (real
daemons, real Redis and SeaweedFS servers, the tiny random Llama).

For each tier kind the daemon has that one tier only. Node 1 serves tenant A, then tenant B, the
same prompt: B hits nothing of A's (not in the engine's own radix tree, not in the daemon's
lookup, no token loaded) although A's pages are in both. Node 2 is another engine on the daemon
that serves that tier afterwards: the same daemon (cpu), the same daemon restarted (disk: found
again from its keys), or a fresh daemon on the same server (redis, s3: the blocks are found in
the shared server itself, so the tenant tag must have reached it). Through the HTTP API a third
tenant C gets ``cached_tokens`` 0 and A gets its whole prompt from that tier. Chunks: A's
document chunks, stored through the daemon chunk store on node 1, are never a hit for C on node 2
and always one for A. The daemon charges each tenant its own bytes in that tier, and in Redis and
S3 every block of A's is stored under A's tag.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest

from connector.blend import BlendConfig, build_blend_request
from connector.blend.daemon_store import DaemonChunkStore
from connector.blend.frontend import add_blend_request
from connector.state import kv_state
from connector.wiring import attach_cacheblend
from engine.sampling import SamplingParams
from kvstore.keys import TENANT_MAGIC, tenant_tag
from kvstore.store.tenants import name_of_salt
from tests.connector.support import attach, detach, prompt, run
from tests.fixtures_engine import make_engine
from tests.fixtures_kvstore import connect, daemon
from tests.fixtures_servers import TEST_BUCKET

pytestmark = pytest.mark.timeout(600)
N, PAGES = 120, 7  # a 120-token prompt: 7 loadable pages of 16 (the last token is always computed)
SYSTEM = "You answer questions about the island of Orvik from the documents below.\n"
DOCS = ["The lighthouse of Orvik was built in 1852 by the engineer Talia Novak. ",
        "Orvik's harbour freezes every February, and the ferries then stop. "]
QUESTION = "Question: Who built the lighthouse? Answer:"


def _tier(kind: str, tmp: Path, request: pytest.FixtureRequest) -> tuple[list[str], dict[str, str], str]:
    """Flags of a daemon with the one tier ``kind``, its environment, and the tier's key prefix on its server."""
    if kind == "cpu":
        return ["--cpu", "64MiB"], {}, ""
    if kind == "disk":
        return ["--disk", f"{tmp / 'disk'}:256MiB"], {}, ""
    if kind == "redis":
        return ["--redis", request.getfixturevalue("redis_url")], {}, "tierkv:"
    ep = request.getfixturevalue("s3_endpoint")
    env = {"AWS_ACCESS_KEY_ID": ep.access_key, "AWS_SECRET_ACCESS_KEY": ep.secret_key,
           "AWS_DEFAULT_REGION": ep.region}
    prefix = f"tenants-{uuid.uuid4().hex[:8]}/"
    return ["--s3", f"s3://{TEST_BUCKET}/{prefix}", "--s3-endpoint", ep.url], env, prefix


def _stored_under(kind: str, prefix: str, salt: str, request: pytest.FixtureRequest) -> int:
    """Blocks the shared server itself holds under the tenant's tag (its keys start with it)."""
    tagged = TENANT_MAGIC + tenant_tag(salt)
    if kind == "redis":
        import redis

        r = redis.Redis.from_url(request.getfixturevalue("redis_url"))
        try:
            # the tag is raw bytes: escape what a MATCH pattern reads as a glob ([ ] * ? and backslash)
            pattern = re.sub(rb"([\\[\]*?])", rb"\\\1", prefix.encode() + tagged) + b"*"
            return sum(1 for _ in r.scan_iter(match=pattern, count=1000))
        finally:
            r.close()
    import boto3

    ep = request.getfixturevalue("s3_endpoint")
    s3 = boto3.client("s3", endpoint_url=ep.url, aws_access_key_id=ep.access_key,
                      aws_secret_access_key=ep.secret_key, region_name=ep.region)
    listing = s3.list_objects_v2(Bucket=TEST_BUCKET, Prefix=prefix + tagged.hex())
    return int(listing.get("KeyCount", 0))


def _tenants(address: str, kind: str) -> dict[str, int]:
    with connect(address, use_shm=False) as c:
        return {t.tenant: t.blocks for t in c.stats().tenants if t.tier == kind}


def _http_usage(engine, ids: list[int], salts: list[str]) -> list[dict]:
    """usage of one completion per salt, through the OpenAI server, in order."""
    from fastapi.testclient import TestClient

    from engine.async_engine import AsyncEngine
    from engine.server import create_app

    aengine = AsyncEngine(engine)
    aengine.start()
    try:
        with TestClient(create_app(aengine, "tiny")) as http:
            return [http.post("/v1/completions", json={"prompt": ids, "max_tokens": 4, "ignore_eos": True,
                                                       "cache_salt": salt, "temperature": 0}).json()
                    for salt in salts]
    finally:
        aengine.shutdown()


def _blend(engine, hook, spec, salt: str):
    rid = add_blend_request(engine, spec, SamplingParams(max_tokens=4, ignore_eos=True), cache_salt=salt)
    req = engine.requests[rid]
    while not req.finished:
        engine.step()
    return req


@pytest.mark.parametrize("kind", ["cpu", "disk", "s3", "redis"])
def test_no_tenant_hits_another_tenants_prompt_through_the_tier(kind: str, tiny, tiny4_loaded, tmp_path: Path,
                                                                request: pytest.FixtureRequest) -> None:
    flags, env, prefix = _tier(kind, tmp_path, request)
    run_id = uuid.uuid4().hex[:8]  # fresh tenants: the session's Redis is shared with other tests
    a, b, c = (f"{t}-{run_id}" for t in ("tenant-a", "tenant-b", "tenant-c"))
    ids = prompt(N, seed=41)
    want = run(make_engine(tiny), ids, max_tokens=4).output_ids
    # blending on 4 layers: with 2 every layer would be recomputed and no chunk KV reused
    _, spec = build_blend_request(tiny4_loaded.tokenizer, SYSTEM, DOCS, QUESTION, ratio=0.5)
    chunks = len(spec.segments) - 1  # the system head and each document (the question is computed)

    first = daemon(tmp_path, *flags, env=env)
    d1 = first.__enter__()
    try:
        # -- node 1: A, then B, the same prompt on one engine --------------------------------------
        e1 = make_engine(tiny)
        c1 = attach(e1, d1.address, write_through=True)
        try:
            a1 = run(e1, ids, max_tokens=4, salt=a)
            assert c1.flush(60)
            b1 = run(e1, ids, max_tokens=4, salt=b)
            assert (b1.usage.radix, b1.usage.loaded, b1.cached_tokens) == (0, 0, 0)  # A's pages are in both
            assert kv_state(b1).view is not None and kv_state(b1).view.tiers == [None] * PAGES  # the daemon has none of B's
            assert c1.metrics.value("tierkv_connector_loaded_tokens_total", tier=kind) == 0
            assert a1.output_ids == b1.output_ids == want
            assert c1.flush(60)
        finally:
            detach(e1)
        e1b = make_engine(tiny4_loaded)
        hook1 = attach_cacheblend(e1b, BlendConfig(), store=DaemonChunkStore(connect(d1)))
        try:
            _blend(e1b, hook1, spec, a)
            assert (hook1.metrics.chunk_hits, hook1.metrics.chunk_misses) == (0, chunks)
        finally:
            hook1.close()
        assert _tenants(d1.address, kind) == {name_of_salt(a): PAGES + chunks, name_of_salt(b): PAGES}
        if kind in ("redis", "s3"):  # the tag reached the shared server: every block of A's carries it
            assert _stored_under(kind, prefix, a, request) == PAGES + chunks
            assert _stored_under(kind, prefix, c, request) == 0
        # -- node 2 ---------------------------------------------------------------------------------
        if kind != "cpu":  # the same disk after a restart; the same Redis/S3 from another daemon
            first.__exit__(None, None, None)
            first = daemon(tmp_path, *flags, env=env)
            d2 = first.__enter__()
            if kind == "disk":
                assert _tenants(d2.address, kind) == {name_of_salt(a): PAGES + chunks, name_of_salt(b): PAGES}
        else:
            d2 = d1
        e2 = make_engine(tiny)
        c2 = attach(e2, d2.address)
        try:
            u_c, u_a, u_b = (r["usage"]["prompt_tokens_details"] for r in _http_usage(e2, ids, [c, a, b]))
            assert u_c["cached_tokens"] == 0 and u_c["tierkv"]["cached"] == {
                "radix": 0, "daemon": 0, "blend_prefix": 0, "blend_reused": 0}
            assert {o["reason"] for o in u_c["tierkv"]["pages"]["outcomes"]} == {"absent", "tail"}
            for u in (u_a, u_b):  # each of A and B finds its own prompt, from this tier
                assert u["cached_tokens"] == PAGES * 16 and u["tierkv"]["cached"]["daemon"] == PAGES * 16
                assert u["tierkv"]["daemon_tier"] == kind
            assert c2.metrics.value("tierkv_connector_loaded_tokens_total", tier=kind) == 2 * PAGES * 16
        finally:
            detach(e2)
        e2b = make_engine(tiny4_loaded)
        hook2 = attach_cacheblend(e2b, BlendConfig(), store=DaemonChunkStore(connect(d2)))
        try:
            r_c = _blend(e2b, hook2, spec, c)
            assert (hook2.metrics.chunk_hits, hook2.metrics.chunk_misses) == (0, chunks)
            assert r_c.usage.reused_exact == r_c.usage.reused_approx == 0 and r_c.cached_tokens == 0
            assert r_c.usage.fresh > 0  # C computed every chunk itself
            r_a = _blend(e2b, hook2, spec, a)
            assert (hook2.metrics.chunk_hits, hook2.metrics.chunk_misses) == (chunks, chunks)
            assert r_a.usage.reused_exact > 0 and r_a.cached_tokens > 0
            assert r_a.output_ids == r_c.output_ids  # same chunks' KV, whoever computed it
        finally:
            hook2.close()
    finally:
        first.__exit__(None, None, None)
