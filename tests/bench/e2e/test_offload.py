"""bench.e2e.support.offload_prefix on the tiny model and a real daemon: what it stores is the KV
of the prompt, even in a pool so small that attaching a connector (its start-up probe takes 16
scratch pages) would evict the pages being saved if they were not held."""

from __future__ import annotations

from pathlib import Path

from bench.e2e.support import Bench, offload_prefix, run
from connector.cost_model import PrefillModel
from connector.wiring import detach_tierkv
from tests.fixtures_kvstore import daemon


def test_offloaded_prefix_reloads_to_the_same_tokens(tiny, tmp_path: Path) -> None:
    b = Bench(tiny, 1, PrefillModel(0.005, 1e-3, 0.0))
    ids = b.text(256) + b.text(24)  # 17 full pages + a partial one
    pages = (len(ids) + 64) // 16 + 8  # 29: 18 for the request, 11 free < the probe's 16
    with daemon(tmp_path, "--cpu", "64MiB") as d:
        eng = b.engine(pages)
        want = run(eng, ids, 8, "s")[2].output_ids
        assert offload_prefix(b, eng, [d.address], ids, "s") == 17
        assert eng.radix.evictable_pages() == eng.radix.total_pages()  # unlocked again
        reader = b.engine(pages)
        b.attach(reader, d.address, load_mode="always")
        try:
            r = run(reader, ids, 8, "s")[2]
        finally:
            detach_tierkv(reader)
        assert r.cached_tokens == 17 * 16 and r.output_ids == want
