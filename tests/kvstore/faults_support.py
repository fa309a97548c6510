"""Helpers shared by the fault tests (no tests here): bounded waits, blocks, per-tier stats."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from kvstore.block import encode_block
from kvstore.client.client import KVStoreClient
from kvstore.store.results import TierStats


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Poll ``cond``, bounded generously (the box is busy); fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.05)


def block(tag: str, i: int, floats: int = 16 * 1024) -> tuple[bytes, bytes]:
    """(key, encoded block) with a payload that tells the blocks apart."""
    key = f"{tag}-{i:012d}".encode()
    return key, encode_block(key, np.full(floats, i, dtype=np.float32), layout="T")


def tier(c: KVStoreClient, name: str) -> TierStats:
    return {t.name: t for t in c.stats().tiers}[name]


def drained(c: KVStoreClient) -> bool:
    """Every spill and write-through queued so far has landed (or was dropped)."""
    return c.stats().pending_blocks == 0
