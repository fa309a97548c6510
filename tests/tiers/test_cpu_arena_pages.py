"""The cpu arena's pages (tiers/cpu.py): what kind it got is reported truthfully (tier attribute,
start-up log, /metrics), ``--no-shm-arena`` gives the daemon a private arena (transparent huge
pages where a memfd gets none), and ``huge_pages`` backs the shared arena with reserved hugetlb
pages when there are enough — else falls back to ordinary pages, logged, never failing later.

The hugetlb test needs 8 free reserved pages (``vm.nr_hugepages``): run as root it reserves them
for itself and gives them back; elsewhere, without them, it skips. The fallback tests run everywhere."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterator

import numpy as np
import pytest

import tiers.memfd as memfd
from kvstore.client.shm import ArenaMap
from kvstore.config.store_config import StoreConfig, TierConfig, load_settings
from kvstore.server.metrics import StoreMetrics
from kvstore.store.tier_factory import build_store
from tiers.cpu import ARENA_HEADER, HUGE_PAGE, CpuTier
from tiers.errors import ConfigError


def _round_trip(tier: CpuTier) -> None:
    """A block put and read back, in place and through a client's read-only mapping."""
    data = np.random.default_rng(0).integers(0, 256, 3 * 4096 + 17, dtype=np.uint8).tobytes()
    tier.put(b"k" * 16, data)
    view = tier.get(b"k" * 16)
    assert view is not None and bytes(view) == data
    share = tier.share()
    if share is not None:
        offset = tier.arena_offset(view)
        assert offset is not None
        arena = ArenaMap(os.dup(share.fd), share.size, share.token)
        try:
            assert bytes(arena.view(offset, len(data))) == data
        finally:
            arena.close()


def _free_hugetlb_bytes() -> int:
    try:
        info = dict(line.split(":", 1) for line in open("/proc/meminfo"))  # noqa: SIM115
    except OSError:
        return 0
    return int(info.get("HugePages_Free", "0").split()[0]) * int(info.get("Hugepagesize", "0 kB").split()[0]) * 1024


def test_page_kind_follows_the_kernels_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    modes = {"enabled": "madvise", "shmem_enabled": "never"}  # this VM's: anonymous THP, no shmem THP
    monkeypatch.setattr(memfd, "_thp_mode", lambda which: modes[which])
    with CpuTier(1 << 20) as shared, CpuTier(1 << 20, shared=False) as private:
        assert shared.share() is not None and shared.page_kind == "4KiB"
        assert private.share() is None and private.page_kind == "thp"
    modes.update(enabled="never", shmem_enabled="advise")  # the memfd is madvised: THP where "advise"
    with CpuTier(1 << 20) as shared, CpuTier(1 << 20, shared=False) as private:
        assert shared.page_kind == "thp" and private.page_kind == "4KiB"


def test_the_real_sysfs_is_read() -> None:
    mode = memfd._thp_mode("shmem_enabled")
    if not os.path.exists("/sys/kernel/mm/transparent_hugepage/shmem_enabled"):
        assert mode == ""
    else:
        text = open("/sys/kernel/mm/transparent_hugepage/shmem_enabled").read()  # noqa: SIM115
        assert f"[{mode}]" in text
    with CpuTier(1 << 20) as tier:
        assert tier.page_kind == ("thp" if mode in ("always", "within_size", "advise", "force") else "4KiB")


def test_huge_pages_that_cannot_be_had_fall_back_to_ordinary_pages(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """No reserved pages: fallocate fails at construction (not a SIGBUS on first touch later); the
    arena is an ordinary memfd of the ordinary size, logged, and works."""
    calls: list[int] = []

    def no_pages(fd: int, offset: int, length: int) -> None:
        calls.append(length)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_pages)
    with caplog.at_level(logging.WARNING, logger="tiers.cpu"), CpuTier(3 << 20, huge_pages=True) as tier:
        assert calls == [4 << 20]  # whole huge pages were asked for (3 MiB + the header)
        assert tier.page_kind != "hugetlb"
        share = tier.share()
        assert share is not None and share.size == ARENA_HEADER + (3 << 20)
        _round_trip(tier)
    assert "hugetlb pages not available" in caplog.text and "nr_hugepages" in caplog.text


def test_huge_pages_on_a_private_arena_is_said_to_do_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tiers.cpu"), CpuTier(1 << 20, shared=False, huge_pages=True) as t:
        assert t.page_kind != "hugetlb"
        _round_trip(t)
    assert "shared arena only" in caplog.text


NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"


@pytest.fixture
def eight_free_hugetlb_pages() -> Iterator[None]:
    """8 free hugetlb pages: there already, or reserved for the test (root) and given back after."""
    if _free_hugetlb_bytes() >= 8 * HUGE_PAGE:
        yield
        return
    try:
        with open(NR_HUGEPAGES) as f:
            before = int(f.read())
        with open(NR_HUGEPAGES, "w") as f:
            f.write(str(before + 8))
    except OSError as e:
        pytest.skip(f"needs 8 free hugetlb pages and cannot reserve them ({e}): set vm.nr_hugepages")
    try:
        if _free_hugetlb_bytes() < 8 * HUGE_PAGE:
            pytest.skip("the kernel could not reserve 8 hugetlb pages (memory too fragmented)")
        yield
    finally:
        with open(NR_HUGEPAGES, "w") as f:
            f.write(str(before))


@pytest.mark.usefixtures("eight_free_hugetlb_pages")
def test_huge_pages_back_the_shared_arena_when_reserved() -> None:
    before = _free_hugetlb_bytes()
    with CpuTier(5 << 20, huge_pages=True) as tier:
        assert tier.page_kind == "hugetlb"
        share = tier.share()
        assert share is not None and share.size == 3 * HUGE_PAGE  # 5 MiB + the header, in whole 2 MiB pages
        assert before - _free_hugetlb_bytes() == 3 * HUGE_PAGE  # allocated up front, all of it
        _round_trip(tier)


def test_config_and_flag(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cpu tier only"):
        TierConfig("disk", 1 << 30, path=str(tmp_path), huge_pages=True)
    s = load_settings(["--cpu", "64Mi", "--cpu-huge-pages"], env={})
    assert [t.huge_pages for t in s.config.tiers if t.kind == "cpu"] == [True]
    s = load_settings(["--cpu", "64Mi"], env={"TIERKV_CPU_HUGE_PAGES": "true"})
    assert [t.huge_pages for t in s.config.tiers if t.kind == "cpu"] == [True]
    assert not any(t.huge_pages for t in load_settings(["--cpu", "64Mi"], env={}).config.tiers)


def test_no_shm_arena_gives_the_daemon_a_private_arena_and_metrics_say_which() -> None:
    for arena, shared in ((True, "true"), (False, "false")):
        store = build_store(StoreConfig(tiers=(TierConfig("cpu", 8 << 20),), shm_arena=arena))
        try:
            top = store.levels[0].tier
            assert isinstance(top, CpuTier) and (top.share() is not None) == arena
            m = StoreMetrics()
            m.bind(store)
            from prometheus_client import generate_latest

            text = generate_latest(m.registry).decode()
            assert f'tierkv_cpu_arena_info{{pages="{top.page_kind}",shared="{shared}"}} 1.0' in text
        finally:
            store.close(flush=False)
