"""Block keys of an engine's pages: chained blake2b keys (kvstore/keys.py) in a namespace made of
the model fingerprint, page size, KV dtype and the request's tenant salt (``cache_salt``).

A request of a tenant (an API key's, or the engine's ``--tenant``) carries a scope made by
engine/tenancy.py: its keys are tagged with the tenant's name, which the daemon checks against the
engine's credential, and the body's salt enters only their digest. A legacy request (no tenant) is
keyed by its salt alone, as before.

Two tenants therefore never compute the same key for the same tokens, and two engines with the
same model and settings always do (no Python ``hash()`` anywhere: stable across processes). A
salted request's keys carry its tenant's tag (the daemon's accounting, kvstore/store/tenants.py).

The leading pages of a prompt that lie inside an operator-declared shared prefix
(engine/shared_prefix.py, the same object the engine's radix tree routes by) are keyed in the
shared namespace, so every tenant finds them; the pages after them chain on under the tenant's
salt. Only the declared tokens are ever keyed shared.

A tenant's namespace is a pure function of the salt, kept for the ``NAMESPACES`` most recent salts
only: clients may send any number of distinct salts, and a salt dropped from the cache gets the very
same namespace again next time (so dropping one can never make two salts share keys).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from engine.shared_prefix import SharedPrefixes
from engine.tenancy import split_salt
from kvstore.keys import BlockKey, Namespace, chain_keys

NAMESPACES = 1024  # tenant namespaces kept (LRU); a miss costs one small blake2b


class KeySpace:
    def __init__(self, fingerprint: str, model_type: str, page_size: int, dtype: torch.dtype,
                 shared: SharedPrefixes | None = None) -> None:  # fmt: skip
        if shared is not None and shared.page_size != page_size:
            raise ValueError(f"shared prefixes of {shared.page_size}-token pages for keys of {page_size}")
        self.page_size = page_size
        self.shared = shared or SharedPrefixes((), page_size)
        self._base = Namespace(arch=model_type, weights_digest=fingerprint, kv_dtype=str(dtype).removeprefix("torch."),
                               page_size=page_size)
        self._tenant = functools.lru_cache(maxsize=NAMESPACES)(self._scoped)  # thread-safe, bounded

    def namespace(self, salt: str | None) -> Namespace:
        return self._tenant(salt) if salt else self._base

    def _scoped(self, salt: str) -> Namespace:
        tenant, sub = split_salt(salt)
        return self._base.in_tenant(tenant, sub) if tenant else self._base.with_tenant(salt)

    def keys(self, tokens: Sequence[int], salt: str | None) -> list[BlockKey]:
        """Keys of every full page of ``tokens`` (a trailing partial page has none)."""
        tokens = list(tokens)
        return chain_keys(self.namespace(salt), tokens, self.page_size, shared_pages=self.shared.shared_pages(tokens))
