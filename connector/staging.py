"""Pages copied out of the KV pool for the offloader, and the encoded blocks made from them.

A page leaves the pool once, on the scheduler thread (the pool may reuse it right after):
- a host pool: straight into its final encoded block (``native_batch.pack_checksum_many``:
  gather each page's per-layer K/V slices and checksum them in the same pass, every page of
  the call at once on several threads), so the offloader only sends;
- an accelerator pool: one device->host copy (``KVPool.read_pages``), packed into blocks by the
  offloader's thread, and only for the pages the daemon does not already hold.
Either way a block is byte for byte what ``kvstore.block.encode_block`` makes of the page.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from connector import native, native_batch
from connector.dtypes import block_dtype
from engine.kv_pool import KVPool
from kvstore.block import encode_header, set_checksum
from kvstore.keys import BlockKey

LAYOUT = "L2PHD"  # layers, k/v, page tokens, kv heads, head dim


class StagedPages:
    def __init__(self, pool: KVPool, keys: list[BlockKey], pages: Sequence[int],
                 in_place: bool | None = None) -> None:
        """Copy ``pages`` (one block each, under ``keys``) out of ``pool``. ``in_place``: pack
        from the pool itself (default: when the pool is in host memory)."""
        if len(keys) != len(pages):
            raise ValueError(f"{len(keys)} keys for {len(pages)} pages")
        self.keys = keys
        self.nbytes = len(pages) * pool.bytes_per_page
        self._dtype = block_dtype(pool.dtype)
        self._shape = pool.block_shape()
        self._page_len = pool.bytes_per_page
        self._blocks: list[bytearray] | None = None
        self._host: torch.Tensor | None = None
        if pool.device.type == "cpu" if in_place is None else in_place:
            self._blocks = self._pack_many(keys, native.page_bytes(pool.kv), list(pages))
        else:
            self._host = pool.read_pages(list(pages))  # [n, L, 2, P, H, D] on the host

    def __len__(self) -> int:
        return len(self.keys)

    def _pack_many(self, keys: Sequence[BlockKey], src, pages: list[int]) -> list[bytearray]:
        """One encoded block per page: every page gathered and checksummed in one native call."""
        headers = [encode_header(k, self._dtype, self._shape, LAYOUT, self._page_len) for k in keys]
        blocks = [bytearray(len(h) + self._page_len) for h in headers]
        for h, b in zip(headers, blocks, strict=True):
            b[: len(h)] = h
        sums = native_batch.pack_checksum_many(headers, src, pages,
                                               [memoryview(b)[len(h) :] for h, b in zip(headers, blocks, strict=True)])
        for b, checksum in zip(blocks, sums, strict=True):
            set_checksum(b, checksum)
        return blocks

    def encoded(self, rows: Sequence[int]) -> list[tuple[BlockKey, bytearray]]:
        """(key, encoded block) of the staged pages at ``rows``."""
        if self._blocks is not None:
            return [(self.keys[i], self._blocks[i]) for i in rows]
        assert self._host is not None
        src = native.page_bytes(self._host.permute(1, 2, 0, 3, 4, 5))  # [L, 2, n, seg], no copy
        rows = list(rows)
        return list(zip([self.keys[i] for i in rows], self._pack_many([self.keys[i] for i in rows], src, rows),
                        strict=True))
