"""ChunkStore over the kvstore daemon, with an optional in-process LRU in front.

Chunks are stored as self-describing kvstore blocks (dtype, shape [L, 2, n, H, D], layout
"L2THD", checksum) under their 16-byte chunk keys, so any engine replica on the node — or
another node sharing the daemon's remote tiers — reuses a document's KV. The daemon failing
never fails a request: a get that errors is a miss (the chunk is recomputed), a put that
errors is dropped; both are counted and logged. A chunk that comes back corrupt (its checksum or
format fails, or it is a valid block of another key) is a miss too, and it is deleted from the
daemon at once (as the prefix loader does for pages, connector/connector.py ``_forget``), so no
request reads it again; the recomputed chunk is stored in its place.
"""

from __future__ import annotations

import logging

import torch

from connector.blend.chunk_cache import InProcessChunkStore
from connector.dtypes import from_block_array, to_block_array
from kvstore.block import encode_block
from kvstore.errors import BlockFormatError, KVStoreError

log = logging.getLogger(__name__)
LAYOUT = "L2THD"


class DaemonChunkStore:
    def __init__(self, client, local: InProcessChunkStore | None = None) -> None:
        self.client = client  # kvstore.client.client.KVStoreClient (or anything with put/get_blocks/lookup)
        self.local = local
        self.errors = 0
        self.corrupt = 0  # corrupt chunks found (and deleted, unless the delete failed: see ``errors``)

    def get(self, key: bytes) -> torch.Tensor | None:
        if self.local is not None and (kv := self.local.get(key)) is not None:
            return kv
        try:
            block = self.client.get_blocks([key])[0]
        except BlockFormatError as e:  # a checksum or format failure: corrupt at rest or in transit
            self._drop_corrupt(key, str(e))
            return None
        except KVStoreError as e:
            self.errors += 1
            log.warning("chunk get from the kvstore failed (%s); recomputing the chunk", e)
            return None
        if block is None:
            return None
        if block.key != key:
            self._drop_corrupt(key, f"it holds the block of key {block.key.hex()}")
            return None
        if block.layout != LAYOUT or len(block.shape) != 5:
            log.warning("kvstore block %s is not a chunk (layout %r); ignoring it", key.hex(), block.layout)
            return None
        kv = from_block_array(block.array())
        if self.local is not None:
            self.local.put(key, kv)
        return kv

    def _drop_corrupt(self, key: bytes, why: str) -> None:
        self.corrupt += 1
        log.warning("chunk %s from the kvstore is corrupt (%s); deleting it and recomputing the chunk", key.hex(), why)
        try:
            self.client.delete([key])
        except KVStoreError as e:
            self.errors += 1
            log.warning("could not delete the corrupt chunk %s from the kvstore (%s)", key.hex(), e)

    def put(self, key: bytes, kv: torch.Tensor) -> None:
        if self.local is not None:
            self.local.put(key, kv)
        arr, dtype = to_block_array(kv)
        try:
            self.client.put(key, encode_block(key, arr, dtype=dtype, layout=LAYOUT))
        except KVStoreError as e:
            self.errors += 1
            log.warning("chunk put to the kvstore failed (%s); kept only in process", e)

    def close(self) -> None:
        self.client.close()
