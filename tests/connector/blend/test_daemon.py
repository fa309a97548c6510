"""Chunks stored in the kvstore daemon are reused by another blender (another process's view)."""

from __future__ import annotations

import torch

from connector.blend import Blender, build_blend_request
from connector.blend.daemon_store import DaemonChunkStore
from engine.model import LlamaModel
from tests.fixtures_kvstore import Daemon, connect

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
