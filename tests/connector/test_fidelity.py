"""Greedy tokens are identical whether the prefix KV was recomputed, hit in the local radix cache,
or loaded from the daemon's cpu, disk, s3 or redis tier (SmolLM2, fp32, real daemons).

The blocks reach each daemon through the connector's own offload path (``save`` of the pages
the first run left in the radix tree), and each daemon has that one tier only, so the load
really comes from it.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from connector.state import kv_state
from tests.connector.support import attach, detach, prompt, run
from tests.fixtures_engine import make_engine
from tests.fixtures_kvstore import daemon

PROMPT_LEN, MAX_TOKENS = 88, 6  # 5 full pages of 16 loadable, 8 prompt tokens computed after them


@pytest.fixture(scope="module")
def reference(smollm):
    engine = make_engine(smollm, num_pages=32)
    ids = prompt(PROMPT_LEN, seed=7)
    cold = run(engine, ids, MAX_TOKENS)
    assert cold.cached_tokens == 0
    return engine, ids, cold.output_ids


def _tier_flags(kind: str, tmp: Path, request: pytest.FixtureRequest) -> tuple[list[str], dict[str, str]]:
    if kind == "cpu":
        return ["--cpu", "64MiB"], {}
    if kind == "disk":
        return ["--disk", f"{tmp / 'disk'}:256MiB"], {}
    if kind == "redis":
        return ["--redis", request.getfixturevalue("redis_url")], {}
    ep = request.getfixturevalue("s3_endpoint")
    env = {"AWS_ACCESS_KEY_ID": ep.access_key, "AWS_SECRET_ACCESS_KEY": ep.secret_key,
           "AWS_DEFAULT_REGION": ep.region}
    return ["--s3", f"s3://tierkv-tests/conn-{uuid.uuid4().hex[:8]}", "--s3-endpoint", ep.url], env


def test_local_radix_hit_is_identical(reference) -> None:
    engine, ids, want = reference
    warm = run(engine, ids, MAX_TOKENS)
    assert warm.cached_tokens == 80 and warm.output_ids == want


@pytest.mark.parametrize("kind", ["cpu", "disk", "s3", "redis"])
def test_daemon_tier_load_is_identical(reference, kind: str, tmp_path: Path, request) -> None:
    engine, ids, want = reference
    flags, env = _tier_flags(kind, tmp_path, request)
    with daemon(tmp_path, *flags, env=env) as d:
        conn = attach(engine, d.address)
        try:
            m = engine.radix.match_prefix(ids[:80], record_stats=False)
            assert m.num_tokens == 80
            conn.save(conn.keyspace.keys(ids[:80], None), m.pages)
            assert conn.flush(60)
            assert conn.metrics.value("tierkv_connector_offload_blocks_total", result="sent") == 5
            assert conn.loader.lookup(conn.keyspace.keys(ids[:80], None), 5.0) == [kind] * 5
            engine.radix.reset()
            conn.known.discard(conn.keyspace.keys(ids[:80], None))
            got = run(engine, ids, MAX_TOKENS)
            decision = kv_state(got).decision
            assert (decision.pages, decision.tier) == (5, kind)
            assert got.cached_tokens == 80
            assert got.output_ids == want
            assert conn.metrics.value("tierkv_connector_loaded_tokens_total", tier=kind) == 80
        finally:
            detach(engine)
