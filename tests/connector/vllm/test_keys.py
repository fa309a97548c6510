"""vLLM block keys: chained, namespaced by model/layout/salt, stable across processes."""

from __future__ import annotations

import subprocess
import sys

from connector.vllm.keys import RequestKeys, VLLMKeySpace, weights_digest
from kvstore.keys import TENANT_MAGIC, tenant_tag

ARCH = {"model_type": "llama", "num_hidden_layers": 2}


def space(**kw: object) -> VLLMKeySpace:
    args = {"arch": ARCH, "weights": "w", "kv_dtype": "torch.bfloat16", "block_size": 4, "layout": "cpu:L"}
    args.update(kw)
    return VLLMKeySpace(**args)  # type: ignore[arg-type]


def test_keys_chain_and_share_prefixes() -> None:
    s = space()
    a, b = s.keys(list(range(12)), None), s.keys(list(range(8)) + [99, 98, 97, 96], None)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert s.keys(list(range(10)), None) == a[:2]  # a trailing partial block has no key


def test_everything_that_changes_the_kv_changes_the_keys() -> None:
    toks = list(range(8))
    base = space().keys(toks, None)
    for other in (space(weights="w2"), space(kv_dtype="torch.float16"), space(layout="cpu:M"),
                  space(arch={**ARCH, "num_hidden_layers": 3})):  # fmt: skip
        assert not set(other.keys(toks, None)) & set(base)
    assert not set(space().keys(toks, "tenant-a")) & set(base)
    assert not set(space().keys(toks, "tenant-a")) & set(space().keys(toks, "tenant-b"))
    assert space().keys(toks, "tenant-a") == space().keys(toks, "tenant-a")


def test_a_deployments_tenant_tags_every_key_and_salts_stay_inside_it() -> None:
    """``tenant`` in the extra config: every key carries the tenant's tag (what the daemon checks
    against the connector's credential), whatever vLLM's per-request cache_salt; the salt still
    separates requests inside the tenant, and no salt of a legacy deployment computes its keys."""
    toks = list(range(8))
    acme = space(tenant="acme")
    tagged = TENANT_MAGIC + tenant_tag("acme")
    for salt in (None, "", "s1", "globex"):
        assert all(k[:8] == tagged for k in acme.keys(toks, salt)), salt
    assert not set(acme.keys(toks, "s1")) & set(acme.keys(toks, "s2"))
    assert acme.keys(toks, None) == acme.keys(toks, "")
    for salt in (None, "acme", "s1"):  # a legacy deployment (no tenant) never computes acme's keys
        assert not set(space().keys(toks, salt)) & (set(acme.keys(toks, "s1")) | set(acme.keys(toks, None)))
    assert not set(space(tenant="globex").keys(toks, "s1")) & set(acme.keys(toks, "s1"))
    rk = RequestKeys(acme, "s1")
    assert rk.upto(toks, 2) == acme.keys(toks, "s1")


def test_request_keys_extend_without_rehashing() -> None:
    s = space()
    toks = list(range(6))
    rk = RequestKeys(s, "t")
    assert rk.upto(toks, 3) == s.keys(toks, "t")  # only one full block so far
    toks += list(range(6, 13))
    assert rk.upto(toks, 3) == s.keys(toks, "t")


def test_keys_are_the_same_in_another_process() -> None:
    code = ("from connector.vllm.keys import VLLMKeySpace as S;"
            "print(S({'model_type':'llama','num_hidden_layers':2},'w','torch.bfloat16',4,'cpu:L')"
            ".keys(list(range(8)),'t')[1].hex())")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == space().keys(list(range(8)), "t")[1].hex()


def test_weights_digest_sees_config_and_weights(tmp_path) -> None:  # noqa: ANN001
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 100)
    d1 = weights_digest(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"y" * 100)
    d2 = weights_digest(tmp_path)
    (tmp_path / "config.json").write_text('{"a": 1}')
    assert len({d1, d2, weights_digest(tmp_path)}) == 3
