"""Disk tier: one lmdb environment on local NVMe.

Why lmdb: copy-on-write B+tree with a single fsync per commit, so a committed block survives a
crash or SIGKILL of the owning process and the tree is never half-written (no recovery step on
open). Large values live in contiguous overflow pages, so a read is one memcpy out of the mmap.

Sizing: lmdb's map is a hard ceiling on the file. Each value costs a page-rounded overflow run
plus tree pages; copy-on-write keeps freed pages busy until older readers finish, and overflow
runs must be contiguous, so churn at capacity fragments the free list. The map is therefore
twice the capacity plus 64 MiB. It is only address space (the file grows as pages are used),
and it is fixed at open: resizing a live map is unsafe while other threads hold read txns.
The TieredStore keeps payload bytes under the capacity; the slack also absorbs a store that
briefly overshoots. A map that still fills up is TierFull: the store evicts and retries, or counts
a refusal; it never detaches the tier for it (reads still work). A write the filesystem refuses
(full, over quota) reaches us from lmdb as a plain I/O error: a TierError like any other.

Ownership: one process owns the environment (the daemon). The store keeps the byte accounting
(its index, rebuilt from ``scan`` at start); the tier keeps none of its own. The directory is
0700 and its files 0600 (every tenant's KV is in them); an existing directory is narrowed to that.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import lmdb

from tiers.base import Buffer, Tier
from tiers.errors import BlockTooLarge, TierError, TierFull, TierUnavailable

_PAGE = 4096
_HEADROOM = 64 << 20


def _round_pages(n: int) -> int:
    return (n + _PAGE - 1) // _PAGE * _PAGE


def _private_dir(path: Path) -> None:
    """The lmdb directory, readable by the daemon's user only (0700): its files hold every
    tenant's KV and key names. Made so if missing; an existing one is narrowed to 0700."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)


class DiskTier(Tier):
    name = "disk"
    persistent = True

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, *, sync: bool = True,
                 map_bytes: int | None = None) -> None:
        """``map_bytes`` overrides the map size (tests of a full map; an existing larger file wins)."""
        super().__init__(capacity_bytes)
        self.path = Path(path)
        self.map_size = _round_pages(map_bytes or self.capacity_bytes * 2 + _HEADROOM)
        self._lock = threading.Lock()  # one write transaction at a time
        try:
            _private_dir(self.path)
            self._env: lmdb.Environment | None = lmdb.open(
                str(self.path),
                map_size=self.map_size,
                subdir=True,
                sync=sync,
                metasync=sync,
                max_dbs=0,
                max_readers=256,
                lock=True,
                mode=0o600,
            )
            for name in ("data.mdb", "lock.mdb"):  # files an older version made 0644
                os.chmod(self.path / name, 0o600)
            self._env.reader_check()  # clear slots of readers that died (e.g. SIGKILL)
        except (OSError, lmdb.Error) as e:
            raise TierUnavailable(self.name, f"cannot open lmdb at {self.path}: {e}") from e

    # -- helpers --------------------------------------------------------------
    def _env_or_raise(self) -> lmdb.Environment:
        if self._env is None:
            raise TierError(self.name, "tier is closed")
        return self._env

    def _check_size(self, value: Buffer) -> None:
        n = memoryview(value).nbytes
        if n > self.capacity_bytes:
            raise BlockTooLarge(f"[disk] block of {n} bytes exceeds capacity {self.capacity_bytes}")

    # -- Tier interface -------------------------------------------------------
    def put(self, key: bytes, value: Buffer) -> None:
        """Write one block in one transaction (one fsync): all or nothing."""
        self._check_size(value)
        try:
            with self._lock, self._env_or_raise().begin(write=True) as txn:
                txn.put(bytes(key), memoryview(value), overwrite=True)
        except lmdb.MapFullError as e:
            raise TierFull(self.name, f"lmdb map full at {self.map_size} bytes: {e}") from e
        except lmdb.Error as e:
            raise TierError(self.name, f"write failed: {e}") from e

    def get(self, key: bytes) -> bytes | None:
        try:
            with self._env_or_raise().begin(buffers=True) as txn:
                buf = txn.get(key)
                return None if buf is None else bytes(buf)  # copy out before the txn ends
        except lmdb.Error as e:
            raise TierError(self.name, f"read failed: {e}") from e

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        try:
            with self._env_or_raise().begin(buffers=True) as txn:
                cur = txn.cursor()
                return [cur.set_key(k) for k in keys]
        except lmdb.Error as e:
            raise TierError(self.name, f"read failed: {e}") from e

    def delete(self, key: bytes) -> bool:
        try:
            with self._lock, self._env_or_raise().begin(write=True) as txn:
                return bool(txn.delete(bytes(key)))
        except lmdb.Error as e:
            raise TierError(self.name, f"delete failed: {e}") from e

    def scan(self) -> Iterator[tuple[bytes, int]]:
        try:
            with self._env_or_raise().begin(buffers=True) as txn:
                items = [(bytes(k), len(v)) for k, v in txn.cursor()]
        except lmdb.Error as e:
            raise TierError(self.name, f"scan failed: {e}") from e
        yield from items

    def close(self) -> None:
        with self._lock:
            if self._env is not None:
                self._env.close()
                self._env = None
