"""An operator-declared shared prefix through the whole engine: two tenants with the same declared
system prompt share its pages (the same pool pages in the radix tree, the same blocks in the
daemon, stored once) and nothing after it; a request cannot make its own tokens shared; the
greedy tokens are those of a fresh prefill; a declared text is shared in chat and completion
prompts through the HTTP API."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engine.engine import LLMEngine
from engine.model_loader import hf_model_dir, load_model
from kvstore.store.tenants import SHARED, name_of_salt
from tests.connector.support import attach, detach, prompt, run
from tests.fixtures_engine import make_engine
from tests.fixtures_kvstore import connect, daemon
from tests.fixtures_model import make_tiny_llama

PS = 16
SYSTEM = prompt(70, seed=51)  # 4 whole pages are declared; its last 6 tokens share a page with the question
SHARED_TOKENS = 64


def _declare(tmp: Path, ids: list[int]) -> Path:
    path = tmp / "shared.yaml"
    path.write_text(f"- ids: {ids}\n")
    return path


def _engine(loaded, shared_file: Path | None) -> LLMEngine:
    if shared_file is None:
        return make_engine(loaded)
    return make_engine(loaded, shared_prefix_file=str(shared_file))


def _tenants(address: str) -> dict[str, int]:
    with connect(address, use_shm=False) as c:
        return {t.tenant: t.blocks for t in c.stats().tenants}


def test_two_tenants_share_the_declared_prompt_and_nothing_after_it(tiny, tmp_path: Path) -> None:
    qa, qb = prompt(50, seed=52), prompt(50, seed=53)
    ref = make_engine(tiny)  # no declaration: every tenant alone, a fresh prefill each
    want_a, want_b = run(ref, SYSTEM + qa).output_ids, run(ref, SYSTEM + qb).output_ids
    assert run(ref, SYSTEM + qb, salt="tenant-b").usage.radix == 0  # without it, B shares nothing
    with daemon(tmp_path, "--cpu", "64MiB") as d:
        eng = _engine(tiny, _declare(tmp_path, SYSTEM))
        conn = attach(eng, d.address, write_through=True)
        try:
            a = run(eng, SYSTEM + qa, salt="tenant-a")
            assert conn.flush(30)
            b = run(eng, SYSTEM + qb, salt="tenant-b")
            assert (b.usage.radix, b.usage.loaded) == (SHARED_TOKENS, 0)  # the declared pages, locally
            pa = eng.radix.match_prefix(SYSTEM + qa, record_stats=False, salt="tenant-a").pages
            pb = eng.radix.match_prefix(SYSTEM + qb, record_stats=False, salt="tenant-b").pages
            assert pa[:4] == pb[:4] and not set(pa[4:]) & set(pb[4:])  # the same pool pages, then each its own
            c = run(eng, SYSTEM + qa, salt="tenant-c")  # A's whole prompt, another tenant: only the declared part
            assert (c.usage.radix, c.usage.loaded) == (SHARED_TOKENS, 0)
            assert (a.output_ids, b.output_ids, c.output_ids) == (want_a, want_b, want_a)
            assert conn.flush(30)
            ka, kb = conn.keyspace.keys(SYSTEM + qa, "tenant-a"), conn.keyspace.keys(SYSTEM + qb, "tenant-b")
            assert ka[:4] == kb[:4] and not set(ka[4:]) & set(kb[4:])
            # in the daemon: the declared pages once, under "shared"; each tenant's own pages under its tag
            own = (len(SYSTEM) + 50 - 1) // PS - 4  # full pages past the declared ones (last token computed)
            assert _tenants(d.address) == {SHARED: 4, **{name_of_salt(t): own for t in ("tenant-a", "tenant-b",
                                                                                      "tenant-c")}}
        finally:
            detach(eng)
        # another replica: a new tenant loads the declared pages from the daemon, and only those
        other = _engine(tiny, _declare(tmp_path, SYSTEM))
        attach(other, d.address)
        try:
            qd = prompt(50, seed=54)
            dd = run(other, SYSTEM + qd, salt="tenant-d")
            assert (dd.usage.radix, dd.usage.loaded, dd.usage.loaded_tier) == (0, SHARED_TOKENS, "cpu")
            assert dd.output_ids == run(ref, SYSTEM + qd).output_ids
            aa = run(other, SYSTEM + qa, salt="tenant-a")  # A: the declared pages D loaded, then its own from the daemon
            assert (aa.usage.radix, aa.usage.loaded) == (SHARED_TOKENS, 48) and aa.output_ids == want_a
            other.radix.check_integrity()
        finally:
            detach(other)


def test_a_request_cannot_make_its_own_tokens_shared(tiny, tmp_path: Path) -> None:
    with daemon(tmp_path, "--cpu", "64MiB") as d:
        eng = _engine(tiny, _declare(tmp_path, SYSTEM))
        conn = attach(eng, d.address, write_through=True)
        try:
            forged = SYSTEM[:40] + prompt(60, seed=55)  # leaves the declaration inside its third page
            run(eng, forged, salt="tenant-a")
            run(eng, prompt(60, seed=56) + SYSTEM, salt="tenant-a")  # the declared tokens, not at the start
            run(eng, forged, salt="")  # nor without a salt
            assert conn.flush(30)
            b = run(eng, forged, salt="tenant-b")
            assert (b.usage.radix, b.usage.loaded) == (2 * PS, 0)  # the 2 declared whole pages, nothing of A's
            assert _tenants(d.address)[SHARED] == 2
            for ks in (conn.keyspace.keys(forged, "tenant-a"), conn.keyspace.keys(forged, None)):
                assert [k[:2] for k in ks[:3]] == [b"s\x01", b"s\x01", ks[2][:2]] and ks[2][:2] != b"s\x01"
            eng.radix.check_integrity()
        finally:
            detach(eng)


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    """The tiny Llama with SmolLM2's chat template, for chat requests."""
    d = make_tiny_llama(tmp_path_factory.mktemp("tiny-chat"))
    shutil.copy(hf_model_dir("") / "chat_template.jinja", d / "chat_template.jinja")
    return load_model(str(d))


def test_a_declared_system_prompt_is_shared_in_chat_and_completions(tiny_chat, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from engine.async_engine import AsyncEngine
    from engine.server import create_app

    system = "You are the help desk of the Orvik ferry company. Answer in one short and friendly sentence. " * 3
    decl = tmp_path / "shared.yaml"
    decl.write_text(f"- text: {system!r}\n")
    eng = _engine(tiny_chat, decl)
    aengine = AsyncEngine(eng)
    aengine.start()

    def chat(user: str, salt: str, with_system: bool = True) -> int:
        msgs = ([{"role": "system", "content": system}] if with_system else []) + [{"role": "user", "content": user}]
        body = {"messages": msgs, "max_tokens": 2, "cache_salt": salt, "temperature": 0}
        return http.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def complete(text: str, salt: str) -> int:
        body = {"prompt": text, "max_tokens": 2, "cache_salt": salt, "temperature": 0}
        return http.post("/v1/completions", json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    try:
        with TestClient(create_app(aengine, "tiny")) as http:
            assert chat("When does the first ferry leave?", "tenant-a") == 0
            shared = chat("Can I bring a bicycle on board?", "tenant-b")
            assert shared > 0 and shared % PS == 0  # the system message's whole pages, from tenant A's request
            assert chat("Can I bring a bicycle on board?", "tenant-c", with_system=False) == 0
            assert complete(system + "Q: Is there a cafe? A:", "tenant-a") == 0
            assert complete(system + "Q: Are dogs allowed? A:", "tenant-b") > 0
    finally:
        aengine.shutdown()
    eng.radix.check_integrity()
