"""kvengine's API keys and tenants (engine/tenancy.py) through the HTTP API, with the tiny model and
no daemon: /v1/* answer 401 without a valid key (/health and /metrics stay open), a request runs in
its key's tenant whatever ``cache_salt`` it sends, a body salt that could spell a scope is refused,
``--tenant`` puts every request in one tenant, and the keys file is checked in one line that never
shows a key."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from engine.async_engine import AsyncEngine
from engine.cli import main as cli_main
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.server import create_app
from engine.tenancy import ApiKeys, scoped_salt, split_salt
from tests.connector.support import prompt
from tests.fixtures_engine import make_engine

KEY_A = "key-of-acme-0123456789abcdef"
KEY_B = "key-of-globex-0123456789abcdef"
IDS = prompt(70, seed=61)  # 4 full pages


@contextmanager
def serving(loaded, **app: object) -> Iterator[tuple[TestClient, object]]:
    engine = make_engine(loaded)
    aengine = AsyncEngine(engine)
    aengine.start()
    try:
        with TestClient(create_app(aengine, "tiny", **app)) as http:  # type: ignore[arg-type]
            yield http, engine
    finally:
        aengine.shutdown()


def _complete(http: TestClient, key: str | None, salt: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"prompt": IDS, "max_tokens": 2, "ignore_eos": True, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    return http.post("/v1/completions", json=body, headers=headers)


def _cached(r) -> int:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_v1_needs_a_valid_key_and_health_does_not(tiny) -> None:
    with serving(tiny, api_keys=ApiKeys({KEY_A: "acme"})) as (http, _):
        for headers in ({}, {"Authorization": "Bearer not-a-key-of-this-server-000"}, {"Authorization": KEY_A}):
            for method, path in (("post", "/v1/completions"), ("post", "/v1/chat/completions"), ("get", "/v1/models")):
                r = getattr(http, method)(path, headers=headers, **({"json": {}} if method == "post" else {}))
                assert r.status_code == 401, (path, headers)
                assert r.headers["www-authenticate"] == "Bearer"
                assert r.json()["error"]["type"] == "authentication_error" and KEY_A not in r.text
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
        assert http.get("/docs").status_code == 401  # deny by default: only the probes are open
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {KEY_A}"}).status_code == 200
        assert _complete(http, KEY_A).status_code == 200


def test_a_request_runs_in_its_keys_tenant_whatever_salt_it_sends(tiny) -> None:
    with serving(tiny, api_keys=ApiKeys({KEY_A: "acme", KEY_B: "globex"})) as (http, engine):
        assert _cached(_complete(http, KEY_A)) == 0
        assert _cached(_complete(http, KEY_A)) == 64  # its own tenant: the radix tree has its pages
        for salt in (None, "acme", "globex", "x" * 40):  # ("" is None: the same scope)
            assert _cached(_complete(http, KEY_B, salt)) == 0, salt  # globex never reaches acme's pages
        assert _cached(_complete(http, KEY_A, "sub")) == 0  # a salt sub-divides acme
        assert _cached(_complete(http, KEY_A, "sub")) == 64
        for spelled in (scoped_salt("acme", ""), scoped_salt("acme", None), "\x1eacme\x1e", "a\nb"):
            r = _complete(http, KEY_B, spelled)  # a scope spelled in the body: refused, never honoured
            assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    m = engine.radix.match_prefix(IDS, record_stats=False, salt=scoped_salt("acme", None))
    assert m.num_tokens == 64  # acme's tree holds its prompt ...
    assert engine.radix.match_prefix(IDS, record_stats=False, salt=None).num_tokens == 0  # ... no legacy tree does


def test_a_legacy_server_refuses_a_salt_that_spells_a_scope(tiny) -> None:
    """Without API keys a body salt is still only a salt: one that could pass for a tenant's scope
    (the connector would key it in that tenant's namespace) is refused."""
    with serving(tiny) as (http, engine):
        assert _complete(http, None, scoped_salt("acme", "")).status_code == 400
        assert _cached(_complete(http, None, "tenant-a")) == 0 and _cached(_complete(http, None, "tenant-a")) == 64
    assert engine.radix.match_prefix(IDS, record_stats=False, salt=scoped_salt("acme", "")).num_tokens == 0


def test_an_engine_of_one_tenant_keeps_every_request_in_it(tiny) -> None:
    with serving(tiny, tenant="acme") as (http, engine):
        assert _cached(_complete(http, None)) == 0 and _cached(_complete(http, None)) == 64
        assert _cached(_complete(http, None, "other")) == 0
    assert engine.radix.match_prefix(IDS, record_stats=False, salt=scoped_salt("acme", None)).num_tokens == 64
    assert engine.radix.match_prefix(IDS, record_stats=False, salt="other").num_tokens == 0


def test_scopes_open_again_into_tenant_and_salt() -> None:
    assert split_salt(scoped_salt("acme", "s")) == ("acme", "s")
    assert split_salt(scoped_salt("acme", None)) == ("acme", "")
    assert split_salt(scoped_salt("acme", "s") + "\x00tierkv-gate") == ("acme", "s\x00tierkv-gate")  # gate shadows
    for legacy in (None, "", "tenant-a", "\x00tierkv-gate"):
        assert split_salt(scoped_salt("", legacy)) == ("", legacy or "")


def test_the_keys_file_is_checked_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "keys.yaml"
    good.write_text(f"{KEY_A}: acme\n{KEY_B}: globex\n")
    keys = ApiKeys.load(good)
    assert keys.tenants == ("acme", "globex") and KEY_A not in repr(keys)
    assert keys.tenant(f"Bearer {KEY_B}") == "globex" and keys.tenant(KEY_B) is None and keys.tenant(None) is None
    for text, needle in (("short-key: acme\n", "at least 16"), (f"{KEY_A}: 'acme corp'\n", "not a tenant name"),
                         (f"{KEY_A}: shared\n", "not a tenant name"), ("- a\n", "mapping"), ("{}\n", "no API keys"),
                         ("[", "cannot read")):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=needle) as e:
            ApiKeys.load(bad)
        assert len(str(e.value).splitlines()) == 1 and KEY_A not in str(e.value)
    bad.write_text("short-key: acme\n")
    assert cli_main(["serve", "--api-keys", str(bad), "--check-config"]) == 2
    err = capsys.readouterr().err
    assert "at least 16" in err and "short-key" not in err
    assert cli_main(["serve", "--api-keys", str(good), "--check-config"]) == 0
    assert cli_main(["serve", "--tenant", "acme", "--api-keys", str(good), "--check-config"]) == 2
    assert cli_main(["serve", "--tenant", "no spaces", "--check-config"]) == 2
    with pytest.raises(ValueError, match="not a tenant name"):
        EngineConfig(tenant="_leading")


def test_a_tenant_past_its_share_gets_429_and_the_others_still_get_in(tiny) -> None:
    """One running place and three waiting: a tenant holds at most half of them (``max_tenant_in_flight``
    0, with API keys); its third request waits at the door (here 0.5 s) for one of them, then 429.
    Without the share acme's third request took a place too, and a fourth the last: globex was then
    refused 429 by a flood that was not its own."""
    import threading
    import time

    import httpx
    import uvicorn

    from bench.servers import LOOPBACK, free_port

    aengine = AsyncEngine(make_engine(tiny, max_num_seqs=1, max_waiting=3))  # not started: nothing finishes
    port = free_port()
    app = create_app(aengine, "tiny", api_keys=ApiKeys({KEY_A: "acme", KEY_B: "globex"}), door_wait_s=0.5)
    server = uvicorn.Server(uvicorn.Config(app, host=LOOPBACK, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://{LOOPBACK}:{port}"
    long = {"prompt": IDS, "max_tokens": 8, "stream": True}
    try:
        while not server.started:
            thread.join(0.05)
        with httpx.Client(base_url=base, timeout=60) as a1, httpx.Client(base_url=base, timeout=60) as a2, \
                httpx.Client(base_url=base, timeout=60) as b:
            auth_a, auth_b = {"Authorization": f"Bearer {KEY_A}"}, {"Authorization": f"Bearer {KEY_B}"}
            with a1.stream("POST", "/v1/completions", json=long, headers=auth_a) as r1, \
                    a2.stream("POST", "/v1/completions", json=long, headers=auth_a) as r2:
                assert r1.status_code == 200 and r2.status_code == 200
                t0 = time.monotonic()
                r3 = httpx.post(base + "/v1/completions", json=long, headers=auth_a, timeout=60)
                assert r3.status_code == 429 and r3.headers["retry-after"] == "1", r3.text
                assert time.monotonic() - t0 >= 0.5  # it waited at the door first
                assert "its share" in r3.json()["error"]["message"]
                with b.stream("POST", "/v1/completions", json=long, headers=auth_b) as rb:
                    assert rb.status_code == 200  # globex's place was kept
    finally:
        server.should_exit = True
        thread.join(30)


def test_in_flight_counts_each_tenant_and_forgets_the_idle_ones() -> None:
    from engine.errors import OverloadedError
    from engine.limits import InFlight, tenant_in_flight

    seen: list[int] = []
    f = InFlight(4, seen.append, per_tenant=2)
    a1, a2 = f.enter("acme"), f.enter("acme")
    with pytest.raises(OverloadedError, match="its share"):
        f.enter("acme")
    b1, b2 = f.enter("globex"), f.enter("globex")
    with pytest.raises(OverloadedError, match="as many as it takes"):
        f.enter("initech")
    for s in (a1, a2, a2, b1, b2):  # release is idempotent
        s.release()
    assert f.count == 0 and f.by_tenant == {} and seen == [1, 2, 3, 4, 3, 2, 1, 0]
    assert tenant_in_flight(EngineConfig(max_num_seqs=4, max_waiting=12), several_tenants=True) == 8
    assert tenant_in_flight(EngineConfig(max_num_seqs=4, max_waiting=12), several_tenants=False) == 16
    assert tenant_in_flight(EngineConfig(max_num_seqs=4, max_waiting=12, max_tenant_in_flight=3), True) == 3
    assert tenant_in_flight(EngineConfig(max_num_seqs=1, max_waiting=0), several_tenants=True) == 1


def test_a_request_at_its_tenants_share_waits_at_the_door_for_a_place() -> None:
    """Oldest first, for a place of its own tenant; 429 past the wait or past the door's room; a
    waiter that goes away takes nothing with it. Without the door, each got a 429 at once, and a
    client that asks again at once had the server answer 429s in a loop."""
    import asyncio

    from engine.errors import OverloadedError
    from engine.limits import InFlight

    async def scenario() -> None:
        f = InFlight(2, per_tenant=1)
        a = await f.admit("acme")
        first, second = asyncio.create_task(f.admit("acme", 5.0)), asyncio.create_task(f.admit("acme", 5.0))
        await asyncio.sleep(0.01)
        assert f.at_door == 2 and not first.done() and not second.done()
        with pytest.raises(OverloadedError, match="its share"):  # the door holds `capacity` in all
            await f.admit("acme", 5.0)
        b = await f.admit("globex")  # another tenant walks in
        a.release()  # acme's place goes to its oldest request at the door: the count does not move
        handed = await asyncio.wait_for(first, 1.0)
        assert not second.done() and f.count == 2 and f.by_tenant == {"acme": 1, "globex": 1} and f.at_door == 1
        with pytest.raises(OverloadedError, match="as many as it takes"):  # full: 429 at once, no door
            await f.admit("initech", 5.0)
        second.cancel()  # its client went away while it waited
        with pytest.raises(asyncio.CancelledError):
            await second
        assert f.at_door == 0 and f.door == {}
        b.release()
        with pytest.raises(OverloadedError, match="its share"):  # waited its time, then 429
            await f.admit("acme", 0.05)
        assert f.at_door == 0 and f.door == {}
        handed.release()
        assert f.count == 0 and f.by_tenant == {}

    asyncio.run(scenario())
