"""The connector's knowledge of the daemon follows the daemon: after it restarts empty, the keys it
lost are forgotten (KnownKeys) so the engine offloads those prefixes again and hits them again."""

from __future__ import annotations

from pathlib import Path

from tests.connector.support import attach, detach, prompt, run
from tests.fixtures_engine import make_engine
from tests.fixtures_kvstore import daemon

PROMPTS = [prompt(90, seed=100 + i) for i in range(8)]  # 5 full pages each; 8 of them overflow the pool


def _round(eng, conn) -> float:
    """Tokens loaded from the daemon while running every prompt once."""
    before = conn.metrics.value("tierkv_connector_loaded_tokens_total", tier="cpu")
    for ids in PROMPTS:
        run(eng, ids, max_tokens=2)
    assert conn.flush(30)
    return conn.metrics.value("tierkv_connector_loaded_tokens_total", tier="cpu") - before


def test_daemon_restarted_empty_is_refilled(tiny, tmp_path: Path) -> None:
    with daemon(tmp_path, "--cpu", "64MiB") as d:
        eng = make_engine(tiny, num_pages=16)  # room for ~2 prompts: every round evicts (and offloads) the rest
        conn = attach(eng, d.address)
        try:
            _round(eng, conn)
            assert _round(eng, conn) > 0  # round 2 hits what round 1's evictions offloaded
            address = d.address
            d.kill()  # SIGKILL: everything it held is gone
            d.start(listen=address)  # the same address, empty (cpu tier only)
            loaded = [_round(eng, conn) for _ in range(2)]
            assert loaded[-1] > 0, loaded  # within two rounds the prefixes are back in the daemon and hit
            eng.radix.check_integrity()
            eng.pool.allocator.check_integrity()
        finally:
            detach(eng)
