"""/metrics names a configured tenant as the Stats RPC does (kvstore/server/metrics.py, wired by the
daemon from its credentials), keeps the bounded cardinality, and leaves unknown tags hex."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import numpy as np

from kvstore.block import encode_block
from kvstore.client.retry import Retry
from kvstore.keys import Namespace, chain_keys
from kvstore.server.auth import ClientAuth
from kvstore.server.metrics import METRIC_TENANTS
from kvstore.store.tenants import OTHER, name_of_tenant
from tests.fixtures_kvstore import connect, served

NS = Namespace.from_model({"n_layer": 2}, "sha256:tm", "float32", page_size=4)
OPS = "ops-token-0123456789abcdef0000"
BLOCK = 64 * 1024
MANY = [f"t{i:02d}" for i in range(METRIC_TENANTS + 4)]  # more configured tenants than /metrics labels


def _write_credentials(path: Path, tenants: list[str]) -> None:
    path.write_text("credentials:\n"
                    f"  - token: \"{OPS}\"\n    admin: true\n"
                    f"  - token: \"engine-token-0123456789abcdef\"\n    tenants: [{', '.join(tenants)}]\n")


def _block(key: bytes, n: int) -> bytes:
    head = len(encode_block(key, np.zeros(0, np.uint8)))
    return encode_block(key, np.full(n * BLOCK - head, 1, np.uint8))


def _tenant_series(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("tierkv_tenant_used_bytes{") and 'tier="cpu"' in line:
            out[line.split('tenant="')[1].split('"')[0]] = float(line.split()[-1])
    return out


def test_metrics_name_configured_tenants_bounded_and_unknown_tags_stay_hex(tmp_path: Path) -> None:
    creds = tmp_path / "credentials.yaml"
    _write_credentials(creds, ["acme", *MANY])
    with served(tmp_path, "--cpu", "64MiB", "--credentials-file", str(creds), "--metrics-listen", "127.0.0.1:0") as d:
        # acme and a stranger (a tag no credential lists) are the largest, so both get a series of their own
        puts = [(chain_keys(NS.in_tenant("acme"), list(range(4)))[0], 4),
                (chain_keys(NS.in_tenant("stranger"), list(range(4)))[0], 3)]
        puts += [(chain_keys(NS.in_tenant(t), list(range(4)))[0], 1) for t in MANY]
        with connect(d, deadline_s=10.0, retry=Retry(attempts=1), auth=ClientAuth(OPS), use_shm=False) as ops:
            assert ops.put_many([(k, _block(k, n)) for k, n in puts]) == [True] * len(puts)
        series = _tenant_series(d.metrics_port)
        assert series["acme"] == 4 * BLOCK and name_of_tenant("acme") not in series
        assert series[name_of_tenant("stranger")] == 3 * BLOCK  # unknown: its tag, as before
        assert len(series) == METRIC_TENANTS and OTHER in series  # still the largest N and the rest summed
        named = [t for t in series if t in MANY]
        assert len(named) == METRIC_TENANTS - 3 and not any(name_of_tenant(t) in series for t in MANY)
        assert sum(series.values()) == (4 + 3 + len(MANY)) * BLOCK

        _write_credentials(creds, ["acme", "stranger"])  # the operator names the stranger: SIGHUP
        assert d.reload_credentials()
        series = _tenant_series(d.metrics_port)
        assert series["stranger"] == 3 * BLOCK and name_of_tenant("stranger") not in series
        assert name_of_tenant("t00") in series or OTHER in series  # no longer configured: hex again
        assert "t00" not in series
