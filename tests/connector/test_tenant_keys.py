"""Keys per tenant: a salted key carries its tenant's tag before the hash; the shared namespace is
out of every salt's reach; the connector keys exactly the radix tree's shared pages shared and
chains each tenant's pages on after them; CacheBlend chunk keys are tagged the same way."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from connector.blend.keys import chunk_key
from connector.keys import KeySpace
from engine.shared_prefix import SharedPrefixes
from engine.tenancy import scoped_salt
from kvstore.keys import (
    KEY_BYTES,
    SHARED_MAGIC,
    TAGGED_KEY_BYTES,
    TENANT_MAGIC,
    Namespace,
    chain_keys,
    tenant_tag,
)
from kvstore.store.tenants import SHARED, name_of_salt, tenant_of

PS = 4
SYSTEM = list(range(100, 112))  # 3 pages, declared shared
NS = Namespace.from_model({"n_layer": 2}, "sha256:k", "float32", page_size=PS)


def _space(shared: bool = True) -> KeySpace:
    return KeySpace("sha256:k", "llama", PS, torch.float32, shared=SharedPrefixes([SYSTEM] if shared else [], PS))


def test_a_salted_key_carries_its_tenants_tag() -> None:
    (plain,) = chain_keys(NS, [1, 2, 3, 4])
    (a,) = chain_keys(NS.with_tenant("tenant-a"), [1, 2, 3, 4])
    assert len(plain) == KEY_BYTES and len(a) == TAGGED_KEY_BYTES
    assert a[:2] == TENANT_MAGIC and a[2:8] == tenant_tag("tenant-a") and tenant_of(a) == name_of_salt("tenant-a")
    assert tenant_tag("tenant-a") != tenant_tag("tenant-b") and len(tenant_tag("x")) == 6
    # the tag names, the hash isolates: a's hash is not the default namespace's
    assert a[8:] != plain


def test_no_salt_spells_the_shared_namespace() -> None:
    shared = NS.as_shared()
    assert shared.key_prefix[:2] == SHARED_MAGIC
    for salt in ("", "shared", '{"shared":true}', "True", "null"):
        assert NS.with_tenant(salt).digest != shared.digest
    with pytest.raises(ValueError):
        Namespace(NS.arch, NS.weights_digest, NS.kv_dtype, PS, tenant_salt="a", shared=True)


def test_shared_pages_keyed_shared_then_each_tenant_chains_on() -> None:
    ks = _space()
    prompt = SYSTEM + [7, 7, 7, 7, 8, 8, 8, 8]
    a, b, plain = ks.keys(prompt, "tenant-a"), ks.keys(prompt, "tenant-b"), ks.keys(prompt, None)
    assert a[:3] == b[:3] == plain[:3] and all(tenant_of(k) == SHARED for k in a[:3])
    assert not set(a[3:]) & set(b[3:]) and not set(a[3:]) & set(plain[3:])
    assert {tenant_of(k) for k in a[3:]} == {name_of_salt("tenant-a")}
    # the tenant's pages chain on the shared ones: the same tokens without the declaration differ
    assert _space(shared=False).keys(prompt, "tenant-a")[3:] != a[3:]
    # a prefix of the prompt has the prompt's leading keys (what lookups and offloads rely on)
    assert ks.keys(prompt[:14], "tenant-a") == a[:3] and ks.keys(prompt[:17], "tenant-a") == a[:4]
    # one token off inside the declaration: from that page on, private
    off = ks.keys(SYSTEM[:5] + [0] + SYSTEM[6:], "tenant-a")
    assert off[0] == a[0] and all(tenant_of(k) == name_of_salt("tenant-a") for k in off[1:])


def test_chunk_keys_are_tagged_per_tenant() -> None:
    plain, a = chunk_key("fp", [1, 2, 3]), chunk_key("fp", [1, 2, 3], tenant_salt="tenant-a")
    assert len(plain) == 16 and tenant_of(a) == name_of_salt("tenant-a") and a[8:] != plain
    assert chunk_key("fp", [1, 2, 3], tenant_salt="tenant-b")[8:] != a[8:]


def test_same_tagged_and_shared_keys_in_another_process() -> None:
    code = (
        "import torch\n"
        "from connector.keys import KeySpace\n"
        "from engine.shared_prefix import SharedPrefixes\n"
        f"ks = KeySpace('sha256:k', 'llama', {PS}, torch.float32, shared=SharedPrefixes([{SYSTEM!r}], {PS}))\n"
        f"print(','.join(k.hex() for k in ks.keys({SYSTEM + [5] * 8!r}, 'tenant-a')))\n"
    )
    here = ",".join(k.hex() for k in _space().keys(SYSTEM + [5] * 8, "tenant-a"))
    env = dict(os.environ, PYTHONHASHSEED="4242")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == here


def test_a_tenants_keys_carry_its_name_and_the_salt_only_divides_them() -> None:
    """With a tenant (a credential's), the tag comes from its name, never from the salt, so the
    daemon can check it and charge it; the salt is a sub-namespace (digest only); tenant ``default``
    keys untagged. No legacy salt computes a tenant's keys, nor a tenant another's."""
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    tagged = TENANT_MAGIC + tenant_tag("acme")
    a1, a2, a0 = (chain_keys(NS.in_tenant("acme", s), toks) for s in ("s1", "s2", ""))
    assert all(k[:8] == tagged for k in a1 + a2 + a0) and not set(a1) & set(a2) and not set(a1) & set(a0)
    for legacy in ("acme", "s1", ""):
        assert not set(chain_keys(NS.with_tenant(legacy), toks)) & set(a0 + a1)
    assert chain_keys(NS.with_tenant("acme"), toks)[0][:8] == tagged  # legacy salt "acme": same tag, other keys
    assert not set(chain_keys(NS.in_tenant("globex", "s1"), toks)) & set(a1)
    d = chain_keys(NS.in_tenant("default", "s1"), toks)
    assert all(len(k) == KEY_BYTES for k in d) and not set(d) & set(chain_keys(NS, toks))
    shared = chain_keys(NS.in_tenant("acme", "s1"), toks, shared_pages=1)
    assert shared[0] == chain_keys(NS, toks, shared_pages=1)[0] and shared[0][:2] == SHARED_MAGIC
    with pytest.raises(ValueError, match="not a tenant name"):
        NS.in_tenant("acme corp")
    with pytest.raises(ValueError, match="reserved"):
        NS.in_tenant("shared")
    with pytest.raises(ValueError, match="no tenant or salt"):
        Namespace(NS.arch, NS.weights_digest, NS.kv_dtype, PS, shared=True, tenant="acme")


def test_the_engines_scope_opens_into_tenant_and_salt() -> None:
    """A request of tenant acme (its scope, engine/tenancy.py) is keyed in acme's namespace, pages and
    CacheBlend chunks alike; a legacy salt keeps its old keys."""
    ks, toks = _space(shared=False), list(range(40, 48))
    base = ks.namespace(None)
    assert ks.keys(toks, scoped_salt("acme", "s1")) == chain_keys(base.in_tenant("acme", "s1"), toks)
    assert ks.keys(toks, scoped_salt("acme", None)) == chain_keys(base.in_tenant("acme"), toks)
    assert ks.keys(toks, "tenant-a") == chain_keys(base.with_tenant("tenant-a"), toks)
    c = chunk_key("fp", [1, 2, 3], tenant_salt=scoped_salt("acme", "s1"))
    assert c[:8] == TENANT_MAGIC + tenant_tag("acme")
    assert c != chunk_key("fp", [1, 2, 3], tenant_salt=scoped_salt("acme", "s2"))
    assert c[8:] != chunk_key("fp", [1, 2, 3], tenant_salt="acme")[8:] != chunk_key("fp", [1, 2, 3], tenant_salt="s1")[8:]
    assert len(chunk_key("fp", [1, 2, 3], tenant_salt=scoped_salt("default", ""))) == KEY_BYTES


def test_namespaces_of_ten_thousand_salts_are_not_all_kept() -> None:
    """Without the bound every salt ever seen kept its namespace (~6 MB for these 10,000 salts); a salt
    dropped from the cache gets the same keys again, and never another salt's."""
    import tracemalloc

    from connector.keys import NAMESPACES

    space = _space(shared=False)
    first = space.keys([1, 2, 3, 4], "tenant-0")
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(10_000):
            space.namespace(f"tenant-{i}-" + "s" * 200)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < NAMESPACES * 2_000, grown  # the namespaces of the most recent salts only
    assert space.keys([1, 2, 3, 4], "tenant-0") == first  # evicted long ago: the same keys
    assert space.keys([1, 2, 3, 4], "tenant-1") != first and space.keys([1, 2, 3, 4], None) != first
