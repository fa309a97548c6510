"""Chained block keys: deterministic across processes (PYTHONHASHSEED), namespaced."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore.keys import KEY_BYTES, Namespace, block_key, chain_keys

NS = Namespace.from_model({"n_layer": 30, "hidden": 576}, "sha256:abc", "float16", page_size=4)
TOKENS = list(range(1000, 1011))  # 2 full pages + 3 tokens


def test_full_pages_only_and_chaining() -> None:
    keys = chain_keys(NS, TOKENS)
    assert len(keys) == 2 and all(len(k) == KEY_BYTES for k in keys)
    assert keys[0] == block_key(NS, None, TOKENS[:4])
    assert keys[1] == block_key(NS, keys[0], TOKENS[4:8])
    # same page after a different prefix gets a different key
    other = chain_keys(NS, [7, 7, 7, 7] + TOKENS[4:8])
    assert other[1] != keys[1]
    # a shared prefix shares keys
    assert chain_keys(NS, TOKENS[:8] + [1, 2, 3, 4])[:2] == keys
    assert chain_keys(NS, np.array(TOKENS, dtype=np.int64)) == keys


def test_namespace_separates_models_and_tenants() -> None:
    base = chain_keys(NS, TOKENS)
    assert chain_keys(NS.with_tenant("tenant-b"), TOKENS) != base
    for ns in (
        Namespace.from_model({"n_layer": 30, "hidden": 576}, "sha256:abd", "float16", 4),
        Namespace.from_model({"n_layer": 30, "hidden": 576}, "sha256:abc", "bfloat16", 4),
        Namespace.from_model({"hidden": 576, "n_layer": 31}, "sha256:abc", "float16", 4),
    ):
        assert chain_keys(ns, TOKENS)[0] != base[0]
    # dict order does not matter
    same = Namespace.from_model({"hidden": 576, "n_layer": 30}, "sha256:abc", "float16", 4)
    assert chain_keys(same, TOKENS) == base


def test_bad_tokens() -> None:
    with pytest.raises(ValueError):
        block_key(NS, None, [-1, 2])
    with pytest.raises(ValueError):
        block_key(NS, None, [2**32])
    with pytest.raises(ValueError):
        chain_keys(NS, TOKENS, page_size=8)
    assert chain_keys(NS, TOKENS, page_size=4) == chain_keys(NS, TOKENS)


def test_same_keys_in_subprocess_with_other_hash_seed() -> None:
    code = (
        "from kvstore.keys import Namespace, chain_keys\n"
        "ns = Namespace.from_model({'n_layer': 30, 'hidden': 576}, 'sha256:abc', 'float16', page_size=4)\n"
        f"print(','.join(k.hex() for k in chain_keys(ns, {TOKENS!r})))\n"
    )
    here = ",".join(k.hex() for k in chain_keys(NS, TOKENS))
    for seed in ("1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == here
