"""Chunks stored in the kvstore daemon are reused by another blender (another process's view); a chunk
that comes back corrupt is a miss, deleted from the daemon, and stored again recomputed."""

from __future__ import annotations

import torch

from connector.blend import Blender, build_blend_request
from connector.blend.chunk_cache import ChunkCache
from connector.blend.daemon_store import LAYOUT, DaemonChunkStore
from connector.blend.keys import chunk_key
from connector.dtypes import to_block_array
from engine.model import LlamaModel
from kvstore.block import encode_block
from tests.connector.support import flip_in_place
from tests.fixtures_kvstore import Daemon, connect, served

DOCS = ["Orvik's lighthouse was built in 1852. ", "Its lens came from Esterby. ", "Ferries stop in February. "]


def test_daemon_backed_chunks_are_shared_and_failures_recompute(tiny, tmp_path):
    model = LlamaModel(tiny.arch, tiny.weights, torch.device("cpu"), torch.float32)
    ids, spec = build_blend_request(tiny.tokenizer, "System.\n", DOCS, "Question: when? Answer:")
    d = Daemon(tmp_path, "--cpu", "64MiB").start()
    try:
        with connect(d) as c1, connect(d) as c2:
            b1 = Blender(model, tiny.fingerprint, DaemonChunkStore(c1))
            r1 = b1.blend(b1.plan(spec), 0.15, collect=True)
            assert b1.metrics.chunk_misses == len(spec.segments) - 1
            b2 = Blender(model, tiny.fingerprint, DaemonChunkStore(c2))  # a replica that never saw them
            r2 = b2.blend(b2.plan(spec), 0.15, collect=True)
            assert (b2.metrics.chunk_hits, b2.metrics.chunk_misses) == (len(spec.segments) - 1, 0)
            assert torch.equal(r1.kv, r2.kv) and torch.equal(r1.logits, r2.logits)
    finally:
        d.stop()
    # daemon gone: a miss, the chunk is recomputed, the request still blends
    with connect(d, deadline_s=0.5) as c3:
        store = DaemonChunkStore(c3)
        b3 = Blender(model, tiny.fingerprint, store)
        r3 = b3.blend(b3.plan(spec), 0.15, collect=True)
        assert torch.equal(r3.logits, r1.logits) and store.errors > 0


def test_bfloat16_chunks_round_trip_through_the_daemon(tmp_path):
    kv = torch.randn(2, 2, 5, 2, 16).to(torch.bfloat16)  # a CUDA engine's chunk dtype
    d = Daemon(tmp_path, "--cpu", "64MiB").start()
    try:
        with connect(d) as c:
            store = DaemonChunkStore(c)
            store.put(b"c" * 16, kv)
            assert store.errors == 0
            got = DaemonChunkStore(c).get(b"c" * 16)
            assert got is not None and got.dtype == torch.bfloat16 and torch.equal(got, kv)
    finally:
        d.stop()


def test_a_corrupt_chunk_is_deleted_from_the_daemon_and_stored_again(tmp_path):
    """Without the delete the corrupt block stayed in the daemon: every request read it again, failed it,
    and recomputed the chunk."""
    kv = torch.randn(2, 2, 5, 2, 16)
    ids = [11, 12, 13, 14, 15]
    key = chunk_key("sha256:test", ids)
    with served(tmp_path, "--cpu", "64MiB") as d, connect(d) as c:
        store = DaemonChunkStore(c)
        store.put(key, kv)
        flip_in_place(d.store.levels[0].tier, key)  # the daemon serves its top tier unverified
        assert store.get(key) is None and store.corrupt == 1 and store.errors == 0
        assert c.lookup([key]).tiers == [None]  # gone: no request reads it again
        recomputed = []
        cache = ChunkCache(store, "sha256:test", lambda i, kind: recomputed.append(i) or kv)
        assert torch.equal(cache.get(ids), kv) and recomputed == [ids]  # a miss: computed and stored again
        again = DaemonChunkStore(c).get(key)  # another replica reads the repaired chunk, verified
        assert again is not None and torch.equal(again, kv) and store.corrupt == 1
        # a valid block of another key under this one (a tier's own mix-up) is as bad: deleted too
        arr, dtype = to_block_array(kv)
        d.store.levels[0].tier.put(key, encode_block(chunk_key("sha256:test", [1, 2, 3]), arr, dtype=dtype,
                                                     layout=LAYOUT))
        assert store.get(key) is None and store.corrupt == 2
        assert c.lookup([key]).tiers == [None]
