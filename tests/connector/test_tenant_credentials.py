"""kvengine's tenants over a daemon with a credentials file (a real daemon process, the tiny Llama).

Two API keys of two tenants on engines whose daemon credential lists both: one tenant never hits
the other's blocks in the daemon, with any ``cache_salt`` (the daemon's own hit counter says so,
not the engine's usage), while its own prompt is a daemon hit on another replica. An engine whose
credential lacks a tenant gets PERMISSION_DENIED for that tenant's requests, counted as a lookup
error, and recomputes the right tokens, while its other tenant keeps loading. The start-up probe
writes where the credential allows, and shared-prefix pages, which only an admin writes, do not
cost a tenant's engine its own offloads."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from connector.calibrate import probe_daemon
from connector.loader import Loader
from engine.async_engine import AsyncEngine
from engine.server import create_app
from engine.tenancy import ApiKeys, scoped_salt
from kvstore.client.retry import Retry
from kvstore.errors import PermissionDenied
from kvstore.server.auth import ClientAuth
from kvstore.store.tenants import SHARED
from tests.connector.support import attach, detach, prompt, run
from tests.fixtures_engine import make_engine
from tests.fixtures_kvstore import connect, daemon

pytestmark = pytest.mark.timeout(600)
ENGINES = "engines-token-0123456789abcdef"  # tenants acme and globex
ACME_ONLY = "acme-only-token-0123456789abcd"
OPS = "ops-token-0123456789abcdef0000"
KEY_A, KEY_B = "key-of-acme-0123456789abcdef", "key-of-globex-0123456789abcdef"
IDS = prompt(70, seed=71)  # 4 loadable pages of 16
PAGES = 4


def _credentials(tmp: Path) -> Path:
    path = tmp / "credentials.yaml"
    path.write_text(f"""credentials:
  - token: "{ENGINES}"
    tenants: [acme, globex]
  - token: "{ACME_ONLY}"
    tenants: [acme]
  - token: "{OPS}"
    admin: true
""")
    return path


@contextmanager
def _daemon(tmp: Path) -> Iterator[object]:
    with daemon(tmp, "--cpu", "64MiB", "--credentials-file", str(_credentials(tmp))) as d:
        yield d


def _ops(d: object):
    return connect(d, use_shm=False, retry=Retry(attempts=1), auth=ClientAuth(OPS))


def _hits(d: object) -> int:
    with _ops(d) as c:
        return sum(t.hits for t in c.stats().tiers)


def _rows(d: object) -> dict[str, int]:
    with _ops(d) as c:
        return {t.tenant: t.blocks for t in c.stats().tenants}


@contextmanager
def _http(engine) -> Iterator[TestClient]:
    aengine = AsyncEngine(engine)
    aengine.start()
    try:
        with TestClient(create_app(aengine, "tiny", api_keys=ApiKeys({KEY_A: "acme", KEY_B: "globex"}))) as http:
            yield http
    finally:
        aengine.shutdown()


def _complete(http: TestClient, key: str, salt: str | None = None) -> dict:
    body = {"prompt": IDS, "max_tokens": 4, "ignore_eos": True, "temperature": 0,
            **({"cache_salt": salt} if salt is not None else {})}
    r = http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r.json()


def test_two_keys_of_two_tenants_never_share_kv(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _daemon(tmp_path) as d:
        monkeypatch.setenv("TIERKV_TOKEN", ENGINES)  # the engines' credential (after the daemon started)
        e1 = make_engine(tiny)
        c1 = attach(e1, d.address, write_through=True)
        try:
            with _http(e1) as http:
                want = _complete(http, KEY_A)["choices"][0]["text"]
            assert c1.flush(60)
        finally:
            detach(e1)
        assert _rows(d) == {"acme": PAGES}  # acme's pages, by its name; nothing anyone could call globex's
        e2 = make_engine(tiny)  # another replica: an empty radix tree, so every hit would be the daemon's
        c2 = attach(e2, d.address)
        try:
            with _http(e2) as http:
                before = _hits(d)
                for salt in (None, "acme", "globex", "salt-1"):
                    r = _complete(http, KEY_B, salt)
                    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, salt
                    assert r["choices"][0]["text"] == want  # the same tokens, computed
                assert _hits(d) == before  # globex's lookups found nothing of acme's: no block read
                r = _complete(http, KEY_A)  # the control: acme's own prompt is a daemon hit on this replica
                assert r["usage"]["prompt_tokens_details"]["tierkv"]["cached"]["daemon"] == PAGES * 16
                assert r["choices"][0]["text"] == want
                assert _hits(d) >= before + PAGES
                after = _hits(d)  # acme's pages are in this replica's radix tree now: still not globex's
                assert _complete(http, KEY_B, "salt-2")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                assert _hits(d) == after
            assert c2.metrics.value("tierkv_connector_loaded_tokens_total", tier="cpu") == PAGES * 16
        finally:
            detach(e2)


def test_a_tenant_the_credential_lacks_recomputes_and_the_other_keeps_loading(tiny, tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    acme, globex = scoped_salt("acme", None), scoped_salt("globex", None)
    want = run(make_engine(tiny), IDS, max_tokens=4).output_ids
    with _daemon(tmp_path) as d:
        monkeypatch.setenv("TIERKV_TOKEN", ACME_ONLY)
        seed = make_engine(tiny)
        c0 = attach(seed, d.address, write_through=True)
        run(seed, IDS, max_tokens=4, salt=acme)
        assert c0.flush(60)
        detach(seed)
        eng = make_engine(tiny)
        conn = attach(eng, d.address, write_through=True, down_backoff_s=600.0)
        try:
            g = run(eng, IDS, max_tokens=4, salt=globex)  # its keys are globex's: refused
            assert g.output_ids == want and g.usage.loaded == 0
            assert conn.metrics.value("tierkv_connector_lookups_total", result="error") == 1
            a = run(eng, IDS, max_tokens=4, salt=acme)  # the daemon is not "down" for acme
            assert a.output_ids == want and a.usage.loaded == PAGES * 16
            conn.flush(60)
            assert conn.metrics.value("tierkv_connector_offload_blocks_total", result="failed") == PAGES
        finally:
            detach(eng)
        assert _rows(d) == {"acme": PAGES}


def test_the_probe_writes_in_a_tenant_the_engine_serves(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _daemon(tmp_path) as d:
        eng = make_engine(tiny, tenant="acme")
        with connect(d, use_shm=False, retry=Retry(attempts=1), auth=ClientAuth(ACME_ONLY)) as c:
            loader = Loader(c, eng.view.pool, 32 << 20)
            with pytest.raises(PermissionDenied):
                probe_daemon(c, loader, eng.view, n_blocks=2, tenant="")  # untagged scratch keys: not acme's
            assert probe_daemon(c, loader, eng.view, n_blocks=2, tenant="acme") is not None
        assert "acme" not in _rows(d)  # its scratch blocks were deleted after
        monkeypatch.setenv("TIERKV_TOKEN", ACME_ONLY)
        conn = attach(eng, d.address)
        try:
            assert conn.cfg.probe_tenant == "acme"  # the composition root took it from --tenant
        finally:
            detach(eng)


def test_shared_pages_refused_do_not_cost_a_tenant_its_own_offloads(tiny, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    system = prompt(64, seed=72)  # 4 declared pages
    decl = tmp_path / "shared.yaml"
    decl.write_text(f"- ids: {system}\n")
    with _daemon(tmp_path) as d:
        monkeypatch.setenv("TIERKV_TOKEN", ACME_ONLY)
        eng = make_engine(tiny, shared_prefix_file=str(decl))
        conn = attach(eng, d.address, write_through=True)
        try:
            for q in (73, 74):
                run(eng, system + prompt(40, seed=q), max_tokens=2, salt=scoped_salt("acme", None))
                assert conn.flush(60)
            own = 2 * ((64 + 40 - 1) // 16 - 4)  # each request's full pages past the declared ones
            assert _rows(d) == {"acme": own}  # no shared row: only an admin writes there
            assert conn.metrics.value("tierkv_connector_offload_blocks_total", result="refused") >= 4
            assert conn.metrics.value("tierkv_connector_offload_blocks_total", result="sent") == own
        finally:
            detach(eng)
        assert SHARED not in _rows(d)
