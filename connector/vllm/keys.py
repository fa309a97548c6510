"""Block keys for vLLM's blocks: the same chained blake2b keys as kvengine's pages (kvstore/keys.py),
in a namespace of everything that changes the KV for the same tokens.

The namespace folds in the model (architecture config and a digest of the weights), vLLM's block
size, the KV dtype, the device and the per-layer block shape the attention backend uses, the
deployment's tenant (``tenant`` in kv_connector_extra_config: the tag of every key, which the daemon
checks against the connector's credential) and the request's ``cache_salt`` (vLLM's per-request
salt; with a tenant it only sub-divides the tenant's namespace, without one it is the tenant, as
before). So two tenants never compute the same key, two
vLLM replicas of one model with the same settings always do, and a replica with another KV layout
never reads (or overwrites) blocks it could not use. No Python ``hash()`` anywhere: keys are the
same in every process and after every restart.

The weights digest covers config.json and, for each weight file, its name, its size and its first
and last MiB: a real model's weights are many GB, and hashing them whole at every start-up would
cost minutes. An operator who wants a stronger (or a deliberately shared) identity passes
``model_fingerprint``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvstore.keys import BlockKey, Namespace, block_key, chain_keys

_EDGE = 1 << 20  # bytes read from each end of a weight file
WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.gguf")


def weights_digest(model_dir: str | Path) -> str:
    """A digest of a model directory's config and weights (module doc: what it reads)."""
    root = Path(model_dir)
    h = hashlib.blake2b(digest_size=16, person=b"tierkv-vllm-w1")
    cfg = root / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    files = sorted({p for g in WEIGHT_GLOBS for p in root.glob(g) if p.is_file()}) if root.is_dir() else []
    if root.is_file():
        files = [root]
    for p in files:
        size = p.stat().st_size
        h.update(p.name.encode() + b"\0" + size.to_bytes(8, "little"))
        with open(p, "rb") as f:
            h.update(f.read(_EDGE))
            if size > 2 * _EDGE:
                f.seek(size - _EDGE)
                h.update(f.read(_EDGE))
    return h.hexdigest()


class VLLMKeySpace:
    """Keys of the full blocks of a token sequence, per ``cache_salt``."""

    def __init__(self, arch: Mapping[str, Any], weights: str, kv_dtype: str, block_size: int,
                 layout: str, tenant: str = "") -> None:  # fmt: skip
        self.block_size = block_size
        self.layout = layout
        self.tenant = tenant
        arch_json = json.dumps({"arch": dict(arch), "layout": layout}, sort_keys=True, default=str)
        self._base = Namespace(arch=arch_json, weights_digest=weights, kv_dtype=kv_dtype, page_size=block_size)

    def namespace(self, salt: str | None) -> Namespace:
        if self.tenant:
            return self._base.in_tenant(self.tenant, salt or "")
        return self._base.with_tenant(salt) if salt else self._base

    def keys(self, tokens: Sequence[int], salt: str | None, start_parent: BlockKey | None = None,
             first_block: int = 0) -> list[BlockKey]:  # fmt: skip
        """Keys of every full block of ``tokens`` (a trailing partial block has none).

        ``first_block``/``start_parent``: continue a chain already computed up to block
        ``first_block`` (whose last key is ``start_parent``), hashing only the new blocks."""
        ns = self.namespace(salt)
        if first_block == 0:
            return chain_keys(ns, list(tokens), self.block_size)
        bs = self.block_size
        out: list[BlockKey] = []
        parent: bytes | None = start_parent
        for start in range(first_block * bs, len(tokens) - bs + 1, bs):
            parent = block_key(ns, parent, list(tokens[start : start + bs]))
            out.append(parent)
        return out


class RequestKeys:
    """One request's chain, extended as its tokens grow (prompt, then outputs): each block is
    hashed once however often the scheduler asks."""

    __slots__ = ("space", "salt", "keys")

    def __init__(self, space: VLLMKeySpace, salt: str | None) -> None:
        self.space, self.salt = space, salt
        self.keys: list[BlockKey] = []

    def upto(self, tokens: Sequence[int], n_blocks: int) -> list[BlockKey]:
        """The keys of the first ``n_blocks`` full blocks of ``tokens`` (fewer if it is shorter)."""
        have = len(self.keys)
        if n_blocks > have:
            bs = self.space.block_size
            n_blocks = min(n_blocks, len(tokens) // bs)
            if n_blocks > have:
                parent = self.keys[-1] if self.keys else None
                self.keys += self.space.keys(tokens[: n_blocks * bs], self.salt, parent, have)
        return self.keys[:n_blocks]
