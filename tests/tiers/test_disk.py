"""Disk tier durability: what a process committed is readable after that process is SIGKILLed.

Why a child process: the daemon owning the lmdb environment can die at any moment (OOM killer,
node drain); the next daemon must find every committed block, with sizes, without a repair step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from tiers.disk import DiskTier
from tiers.errors import TierError

pytestmark = pytest.mark.timeout(60)

MiB = 1 << 20
ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from tiers.disk import DiskTier

    def blob(n, seed):
        return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()

    tier = DiskTier(sys.argv[1], 64 << 20)
    for i in range(5):
        tier.put(b"batch-%d" % i, blob((i + 1) * 300_000, i))
    tier.put(b"single", blob(2 << 20, 99))
    tier.delete(b"batch-4")
    print("committed", flush=True)
    i = 0
    while True:  # keep writing so the kill lands mid-transaction
        tier.put(b"churn-%d" % (i % 3), blob(1 << 20, 1000 + i))
        i += 1
    """
)


def blob(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_committed_blocks_survive_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "lmdb"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "committed"
        # Let it write a few churn blocks, then kill it without any chance to clean up.
        time.sleep(0.3)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    assert child.returncode == -signal.SIGKILL

    with DiskTier(path, 64 << 20) as tier:
        for i in range(4):
            assert tier.get(b"batch-%d" % i) == blob((i + 1) * 300_000, i)
        assert tier.get(b"batch-4") is None
        assert tier.get(b"single") == blob(2 << 20, 99)
        sizes = dict(tier.scan())
        assert {k for k in sizes if not k.startswith(b"churn-")} == {b"batch-0", b"batch-1", b"batch-2",
                                                                    b"batch-3", b"single"}
        assert all(n == MiB for k, n in sizes.items() if k.startswith(b"churn-"))
        tier.put(b"after-restart", b"x" * 1000)  # still writable after the crash
        assert tier.get(b"after-restart") == b"x" * 1000


def test_reopen_after_clean_close(tmp_path: Path) -> None:
    with DiskTier(tmp_path, 16 * MiB) as tier:
        tier.put(b"a", blob(MiB, 1))
        tier.put(b"b", blob(MiB // 2, 2))
    with DiskTier(tmp_path, 16 * MiB) as tier:
        assert tier.persistent
        assert dict(tier.scan()) == {b"a": MiB, b"b": MiB // 2}
        assert tier.get(b"b") == blob(MiB // 2, 2)


def test_fills_to_capacity_with_churn(tmp_path: Path) -> None:
    """The map headroom absorbs lmdb's page overhead and copy-on-write when kept at capacity."""
    with DiskTier(tmp_path, 16 * MiB) as tier:
        data = blob(MiB, 3)
        for i in range(16):
            tier.put(b"f%d" % i, data)
        for i in range(48):  # steady state at capacity: the store deletes, then puts
            tier.delete(b"f%d" % (i % 16))
            tier.put(b"f%d" % (i % 16), data[: MiB - 4096 * (i % 5)])
        assert sum(n for _, n in tier.scan()) <= 16 * MiB


def test_map_exhaustion_is_a_tier_error(tmp_path: Path) -> None:
    """A store that never evicts eventually fills the map: a TierError, not an lmdb exception."""
    with DiskTier(tmp_path, MiB, sync=False) as tier:
        data = blob(MiB, 4)
        with pytest.raises(TierError, match="map full"):
            for i in range(200):
                tier.put(b"k%d" % i, data)
        assert tier.get(b"k0") == data


def test_oversized_key_is_a_tier_error(tmp_path: Path) -> None:
    with DiskTier(tmp_path, MiB) as tier, pytest.raises(TierError):
        tier.put(b"k" * 600, b"v")


def test_unwritable_path_is_unavailable(tmp_path: Path) -> None:
    from tiers.errors import TierUnavailable

    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(TierUnavailable):
        DiskTier(blocker / "sub", MiB)


def _mode(p: Path) -> int:
    return p.stat().st_mode & 0o777


def test_the_lmdb_directory_and_files_are_private(tmp_path: Path) -> None:
    """Every tenant's KV and key names are in these files: 0700 directory, 0600 files, whatever
    the umask, and a directory an older version left 0755 (files 0644) is narrowed."""
    old = os.umask(0o022)
    try:
        fresh = tmp_path / "fresh"
        DiskTier(fresh, MiB).close()
        assert _mode(fresh) == 0o700
        assert {p.name: _mode(p) for p in fresh.iterdir()} == {"data.mdb": 0o600, "lock.mdb": 0o600}
        for p in fresh.iterdir():
            p.chmod(0o644)
        fresh.chmod(0o755)
        tier = DiskTier(fresh, MiB)
        tier.close()
        assert _mode(fresh) == 0o700 and {_mode(p) for p in fresh.iterdir()} == {0o600}
    finally:
        os.umask(old)
