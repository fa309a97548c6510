"""The loader copies a block into its pool page first and verifies what it copied; only then
does the page count. A writer that changes the source after any check (a late shared-memory
write) therefore can never put unverified KV into the pool. Runs against a real daemon."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from connector.loader import Loader, _PageCopier
from engine.kv_pool import KVPool
from kvstore.block import BlockHeader, encode_block
from kvstore.client.retry import Retry
from kvstore.keys import BlockKey
from tests.fixtures_kvstore import WAIT_S, Gate, connect, inprocess_daemon

PAGES = 4


class LateWriterCopier(_PageCopier):
    """A page copier whose page ``late_page`` sees its source bytes change after the header was
    checked and before the copy, as a late write into a shared-memory segment would."""

    late_page = -1

    def copy_many(self, pages: Sequence[int], headers: Sequence[BlockHeader], payloads: Sequence[memoryview],
                  budget_s: float) -> list[bool | None]:
        payloads = list(payloads)
        for j, page in enumerate(pages):
            if page == self.late_page:
                changed = bytearray(payloads[j])
                changed[0] ^= 0x01
                payloads[j] = memoryview(changed)
        return super().copy_many(pages, headers, payloads, budget_s)


def _blocks(pool: KVPool) -> tuple[list[BlockKey], list[np.ndarray], list[tuple[bytes, bytes]]]:
    rng = np.random.default_rng(3)
    keys = [BlockKey(b"load-%011d" % i) for i in range(PAGES)]
    arrays = [rng.standard_normal(pool.block_shape()).astype(np.float32) for _ in keys]
    return keys, arrays, [(k, encode_block(k, a, layout="LKTHD")) for k, a in zip(keys, arrays, strict=True)]


def _pool(tiny, cls: type[KVPool] = KVPool) -> KVPool:
    return cls(tiny.arch, num_pages=PAGES + 2, page_size=4, dtype=torch.float32, device=torch.device("cpu"))


def _page(pool: KVPool, page: int) -> np.ndarray:
    return pool.read_pages([page])[0].numpy()


@pytest.mark.parametrize(("use_shm", "use_arena"), [(True, True), (True, False), (False, False)],
                         ids=["shm-in-place", "shm-copied", "stream"])
def test_load_copies_then_verifies(tiny, use_shm: bool, use_arena: bool) -> None:
    pool = _pool(tiny)
    keys, arrays, items = _blocks(pool)
    pages = [1, 2, 3, 4]
    with inprocess_daemon() as d, connect(d, use_shm=use_shm, retry=Retry(attempts=1),
                                                use_arena=use_arena) as c:
        c.put_many(items)
        loader = Loader(c, pool, chunk_bytes=64 * pool.bytes_per_page)
        copier = loader._copier = LateWriterCopier(pool)
        res = loader.load(keys, pages, deadline_s=WAIT_S)
        assert c.arena_active == use_arena
        assert (res.pages_ok, res.failure) == (PAGES, "")
        for p, a in zip(pages, arrays, strict=True):
            assert np.array_equal(_page(pool, p), a)
        pool.kv.zero_()
        copier.late_page = pages[2]
        res = loader.load(keys, pages, deadline_s=WAIT_S)
        assert (res.pages_ok, res.failure) == (2, "checksum")  # the changed page never counts
        for p, a in zip(pages[:2], arrays[:2], strict=True):
            assert np.array_equal(_page(pool, p), a)


def test_staged_copy_for_an_accelerator_pool(tiny) -> None:
    """The path a GPU pool takes (copy into host staging, verify it, upload), run on CPU."""
    pool = _pool(tiny)
    keys, arrays, items = _blocks(pool)
    with inprocess_daemon() as d, connect(d) as c:
        c.put_many(items)
        loader = Loader(c, pool, chunk_bytes=2 * pool.bytes_per_page)  # two chunks
        loader._copier = _PageCopier(pool, in_place=False)
        res = loader.load(keys, [5, 4, 3, 2], deadline_s=WAIT_S)
        assert (res.pages_ok, res.failure) == (PAGES, "")
        for p, a in zip([5, 4, 3, 2], arrays, strict=True):
            assert np.array_equal(_page(pool, p), a)


def test_load_deadline_is_typed(tiny) -> None:
    """A daemon that does not answer in time gives failure "deadline" (KVStoreTimeout), not
    "unavailable" — the connector only marks a daemon down for the latter."""
    pool = _pool(tiny)
    keys, _, items = _blocks(pool)
    with inprocess_daemon() as d, connect(d, retry=Retry(attempts=1)) as c:
        c.put_many(items)
        gate = Gate(keys[0])
        d.store.on_read = gate
        try:
            res = Loader(c, pool, chunk_bytes=64 * pool.bytes_per_page).load(keys, [0, 1, 2, 3], deadline_s=0.5)
        finally:
            gate.release.set()
        assert (res.pages_ok, res.failure) == (0, "deadline")


class BudgetCopier(_PageCopier):
    """A copier whose time budget runs out after ``reached`` blocks (as a slow copy would)."""

    reached = 2

    def copy_many(self, pages: Sequence[int], headers: Sequence[BlockHeader], payloads: Sequence[memoryview],
                  budget_s: float) -> list[bool | None]:
        done = super().copy_many(pages[: self.reached], headers[: self.reached], payloads[: self.reached], budget_s)
        return done + [None] * (len(pages) - len(done))


@pytest.mark.parametrize("use_arena", [True, False], ids=["in-place", "copied"])
def test_blocks_the_copy_did_not_reach_are_a_deadline(tiny, use_arena: bool) -> None:
    """Blocks that arrived but were not copied in the time left end the prefix as a deadline
    (the daemon answered: it is not marked down), and only the copied pages count."""
    pool = _pool(tiny)
    keys, arrays, items = _blocks(pool)
    with inprocess_daemon() as d, connect(d, use_arena=use_arena, retry=Retry(attempts=1)) as c:
        c.put_many(items)
        loader = Loader(c, pool, chunk_bytes=64 * pool.bytes_per_page)
        loader._copier = BudgetCopier(pool)
        res = loader.load(keys, [4, 3, 2, 1], deadline_s=WAIT_S)
        assert (res.pages_ok, res.failure) == (2, "deadline")
        for p, a in zip([4, 3], arrays[:2], strict=True):
            assert np.array_equal(_page(pool, p), a)
