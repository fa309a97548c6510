"""How bench.tiers computes its figures, and that its baselines are set up like the tiers.

The figure functions are pure: each is checked on synthetic timings, including cases where the
figure must come out low or false. The baseline clients are compared with what the tiers build
(lmdb flags, botocore Config, redis-py connection options), so a tier that changes its settings
fails here until bench/tiers/baselines.py follows. No timing is asserted anywhere.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.tiers import figures as fig
from bench.tiers.daemon import figures as daemon_figures
from bench.tiers.page_cache import (
    DirectReader,
    PageCacheError,
    drop_pages,
    lmdb_value_span,
    resident_fraction,
)
from bench.tiers.passes import Passes

pytestmark = pytest.mark.timeout(120)


# -- pure figures -------------------------------------------------------------------------
def test_gbps_is_bytes_over_the_median_pass():
    assert fig.gbps(2_000_000_000, [1.0, 2.0, 100.0]) == pytest.approx(1.0)


@pytest.mark.parametrize("nbytes, secs", [(1, []), (0, [1.0]), (1, [0.0, 1.0]), (1, [-1.0])])
def test_gbps_refuses_timings_that_mean_nothing(nbytes, secs):
    with pytest.raises(fig.FigureError):
        fig.gbps(nbytes, secs)


def test_ratio_of_medians_is_below_one_when_we_are_slower():
    assert fig.ratio_of_medians(ours_s=[2.0, 2.0, 2.0], baseline_s=[1.0, 1.0, 1.0]) == pytest.approx(0.5)
    assert fig.ratio_of_medians(ours_s=[1.0, 1.0, 1.0], baseline_s=[2.0, 2.0, 2.0]) == pytest.approx(2.0)


def test_ratio_of_medians_ignores_one_outlier_pass():
    assert fig.ratio_of_medians([1.0, 1.0, 50.0], [1.0, 1.0, 1.0]) == pytest.approx(1.0)


def test_paired_ratio_pairs_repetitions():
    # The machine got 10x slower for the last two repetitions, on both sides alike: each pair
    # says "half the speed", while the medians of the two sides come from different repetitions.
    ours, base = [2.0, 2.0, 2.0, 20.0, 20.0], [1.0, 1.0, 1.0, 10.0, 10.0]
    assert fig.paired_ratio(ours, base) == pytest.approx(0.5)
    ours, base = [1.0, 1.0, 1.0, 10.0, 10.0], [5.0, 5.0, 5.0, 1.0, 1.0]
    assert fig.paired_ratio(ours, base) == pytest.approx(5.0)
    assert fig.paired_ratio([10.0, 10.0, 1.0], [1.0, 1.0, 5.0]) == pytest.approx(0.1)


def test_paired_ratio_refuses_unpaired_samples():
    with pytest.raises(fig.FigureError):
        fig.paired_ratio([1.0, 1.0], [1.0])


def test_best_baseline_is_the_lowest_median():
    name, secs = fig.best_baseline({"loop": [3.0, 3.0, 3.0], "mget": [1.0, 9.0, 1.0], "pipe": [2.0, 2.0, 2.0]})
    assert name == "mget" and list(secs) == [1.0, 9.0, 1.0]
    with pytest.raises(fig.FigureError):
        fig.best_baseline({})


def test_scaling_ratio_is_below_one_when_more_clients_get_less():
    assert fig.scaling_ratio([2.0, 2.0, 2.0], [1.0, 1.0, 1.0]) == pytest.approx(0.5)
    assert fig.scaling_ratio([1.0, 1.0, 9.0], [3.0, 3.0, 0.5]) == pytest.approx(3.0)
    with pytest.raises(fig.FigureError):
        fig.scaling_ratio([], [1.0])


def test_cold_verified_needs_both_the_drop_and_a_slower_pass():
    cold, warm = [2.0, 2.0, 2.0], [1.0, 1.0, 1.0]
    assert fig.cold_verified(cold, warm, [0.0, 0.01])
    assert not fig.cold_verified(cold, warm, [0.0, 0.5])  # one drop left half the file cached
    assert not fig.cold_verified(warm, cold, [0.0, 0.0])  # "cold" was faster than warm
    assert not fig.cold_verified([1.0], [1.0], [0.0])  # as fast: nothing says it was cold
    with pytest.raises(fig.FigureError):
        fig.cold_verified(cold, warm, [])


def test_meets():
    assert fig.meets(0.9, 0.9) and not fig.meets(0.89, 0.9)


def test_passes_figures_from_synthetic_timings():
    p = Passes(nbytes=1_000_000_000, put_s=[4.0, 4.0, 4.0], get_s=[2.0, 2.0, 4.0], raw_s=[1.0, 1.0, 1.0],
               extra_s={"mget": [0.5, 0.5, 0.5]})
    out = p.figures()
    assert out["put_gbps"] == 0.25 and out["get_gbps"] == 0.5 and out["raw_gbps"] == 1.0
    assert out["ratio"] == 0.5 and out["paired_ratio"] == 0.5 and out["mget_gbps"] == 2.0


def _daemon_timings() -> dict[str, list[float]]:
    """Every path its own speed, so a ratio set against the wrong side comes out wrong."""
    s = {"views": 0.1, "copy": 1.0, "into": 0.5, "tcp_get": 3.0, "tcp_into": 2.5,
         "redis_loop": 8.0, "redis_pipe": 6.0, "redis_mget": 4.0,  # over TCP: MGET is the best, 4 s
         "redisu_loop": 5.0, "redisu_pipe": 2.0, "redisu_mget": 2.5}  # over the unix socket: pipelined, 2 s
    return {k: [v] * 3 for k, v in s.items()}


def test_daemon_ratios_set_each_transport_against_its_own_kind():
    out = daemon_figures({"s": _daemon_timings(), "bytes": 2_000_000_000, "tcp_shm": False})
    assert out["vs_redis"] == round(4.0 / 3.0, 2)  # TCP get (3 s) against Redis's best over TCP (MGET, 4 s)
    assert out["vs_redis_unix"] == 2.0  # shared memory (1 s) against Redis's best over its unix socket (2 s)
    assert out["vs_redis_mixed"] == 4.0  # shared memory against TCP: the old headline, a breakdown
    assert "mget" in out["redis_baseline"] and "TCP" in out["redis_baseline"]
    assert "pipelined_get" in out["redis_unix_baseline"] and out["redis_unix_get_gbps"] == 1.0
    assert out["vs_redis_views"] == 40.0 and out["vs_redis_into"] == 8.0  # breakdowns against TCP, as before
    assert out["tcp_get_gbps"] == round(2 / 3, 3) and out["get_copy_gbps"] == 2.0


def test_daemon_headline_falls_below_one_when_tcp_gets_are_slower_than_redis():
    s = _daemon_timings()
    s["tcp_get"] = [8.0] * 3
    assert daemon_figures({"s": s, "bytes": 1, "tcp_shm": False})["vs_redis"] == 0.5


# -- baselines set up like the tiers -----------------------------------------------------
def test_lmdb_baseline_opens_like_the_disk_tier(tmp_path):
    from bench.tiers.baselines import lmdb_open_like
    from tiers.disk import DiskTier

    with DiskTier(tmp_path / "tier", 8 << 20) as tier:
        env = lmdb_open_like(tmp_path / "raw", tier.map_size)
        try:
            assert env.flags() == tier._env.flags()
            assert env.info()["map_size"] == tier._env.info()["map_size"]
            assert env.max_readers() == tier._env.max_readers()
        finally:
            env.close()


def test_s3_baseline_uses_the_tiers_botocore_config():
    from bench.servers import S3Endpoint
    from bench.tiers.baselines import s3_client_like
    from tiers.s3 import S3Tier

    ep = S3Endpoint("http://127.0.0.1:9", "key", "secret")  # nothing is called: no server needed
    tier = S3Tier(ep.url, "b", 1 << 20, access_key=ep.access_key, secret_key=ep.secret_key, create_bucket=False)
    client = s3_client_like(ep)
    try:
        skip = {"_supplied_user_agent", "user_agent", "user_agent_extra", "user_agent_appid"}
        ours = {k: v for k, v in vars(client.meta.config).items() if k not in skip}
        theirs = {k: v for k, v in vars(tier._client.meta.config).items() if k not in skip}
        assert ours == theirs
        assert ours["response_checksum_validation"] == "when_required"
    finally:
        client.close()
        tier.close()


def test_redis_baseline_uses_the_tiers_connection_options_and_hiredis(redis_url):
    from bench.tiers.baselines import redis_client_like
    from tiers.redis import RedisTier

    names = ("socket_timeout", "socket_connect_timeout", "socket_read_size", "health_check_interval")
    with RedisTier(redis_url, 1 << 20, prefix=b"bench-test:") as tier:
        plain = redis_client_like(redis_url)
        try:
            ours, theirs = plain.connection_pool.connection_kwargs, tier._r.connection_pool.connection_kwargs
            assert {n: ours.get(n) for n in names} == {n: theirs.get(n) for n in names}
            assert ours["socket_read_size"] == 1 << 20
            assert plain.get_retry()._retries == tier._r.get_retry()._retries
            assert type(plain.connection_pool.get_connection()._parser).__name__ == "_HiredisParser"
        finally:
            plain.close()


def test_redis_baseline_refuses_to_run_without_hiredis(monkeypatch):
    import redis.utils

    from bench.tiers.baselines import BaselineError, redis_client_like

    monkeypatch.setattr(redis.utils, "HIREDIS_AVAILABLE", False)
    with pytest.raises(BaselineError, match="hiredis"):
        redis_client_like("redis://127.0.0.1:9/0")


# -- cold disk -----------------------------------------------------------------------------
def _direct_or_skip(path: Path, workers: int = 1) -> DirectReader:
    try:
        return DirectReader(path, 4 << 20, workers=workers, chunk_bytes=64 << 10)
    except PageCacheError as e:
        pytest.skip(f"no O_DIRECT here (tmpfs?): {e}")


def test_direct_reads_the_bytes_lmdb_holds_and_the_drop_empties_the_cache(tmp_path):
    from bench.tiers.baselines import lmdb_open_like

    rng = np.random.default_rng(3)
    vals = {rng.bytes(32): rng.bytes(int(n)) for n in rng.integers(5000, 3 << 20, 6)}
    env = lmdb_open_like(tmp_path / "db", 64 << 20)
    for k, v in vals.items():
        with env.begin(write=True) as txn:
            txn.put(k, v)
    with env.begin(buffers=True) as txn:
        spans = {k: lmdb_value_span(tmp_path / "db" / "data.mdb", txn.get(k)) for k in vals}
    env.close()  # no mapping left: the kernel may drop every page
    data = tmp_path / "db" / "data.mdb"
    for workers in (1, 4):  # one request per range, and 64 KiB pieces several at a time
        with _direct_or_skip(data, workers=workers) as reader:
            for k, v in vals.items():
                assert bytes(reader.read(*spans[k])) == v
            fresh = [reader.read_fresh(*spans[k]) for k in vals]  # each in memory of its own
            assert [bytes(f) for f in fresh] == list(vals.values())
    assert resident_fraction(data) > 0.5  # written and fsynced through the page cache
    drop_pages(data)
    assert resident_fraction(data) <= 0.05


def test_direct_reader_refuses_unaligned_pieces(tmp_path):
    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * 4096)
    with pytest.raises(ValueError, match="multiple"):
        DirectReader(probe, 4096, workers=2, chunk_bytes=1000)


def test_bench_disk_reports_cold_figures_from_a_real_drop(tmp_path):
    from bench.tiers.disk import bench_disk
    from bench.tiers.run import make_blocks

    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * 4096)
    _direct_or_skip(probe).close()
    out = bench_disk(make_blocks(3), reps=2, tmp=tmp_path, cold_reps=2)
    for key in ("ratio", "paired_ratio", "cold_ratio", "cold_gbps", "cold_direct_gbps", "cold_direct1_gbps",
                "cold_direct4_gbps", "cold_direct1_owned_gbps", "cold_direct_fresh_gbps", "cold_lmdb_gbps",
                "cold_baseline_gbps", "cold_direct_ratio", "cold_direct_owned_ratio", "cold_view_ratio",
                "cold_verified"):
        assert key in out, key
    assert out["resident_after_drop_max"] <= 0.05
    assert out["cold_ratio"] > 0 and out["ratio"] > 0
    # the cold ratio is against the fastest baseline that hands back memory the caller owns (as a
    # tier's get does), never a slower one; the view baselines (a buffer the next read reuses)
    # stay reported beside it, in cold_view_ratio
    owned = ("cold_direct1_owned_gbps", "cold_direct_fresh_gbps", "cold_lmdb_gbps")
    assert out["cold_baseline_gbps"] == max(out[k] for k in owned)
    views = max(out[k] for k in ("cold_direct1_gbps", "cold_direct4_gbps", "cold_lmdb_gbps"))
    assert out["cold_view_ratio"] == pytest.approx(out["cold_gbps"] / views, rel=0.02, abs=0.002)


# -- the daemon section, end to end on a real daemon and Redis (tiny plan) ------------------
def test_daemon_bench_compares_at_the_engines_block_size_on_both_transports():
    from bench.tiers.daemon import Plan, measure_daemon
    from bench.tiers.engine_block import engine_block

    out = measure_daemon(quick=True, plan=Plan(blocks=3, rounds=2, scaling_reps=1, scaling_clients=2))
    assert out["shm"] is True and out["tcp_shm"] is False  # the streamed client really streamed
    assert out["block_payload_bytes"] == engine_block().payload_bytes == 720 * 1024  # SmolLM2-135M's page
    assert out["block_payload_bytes"] < out["block_bytes"] < out["block_payload_bytes"] + 4096  # + its header
    for key in ("vs_redis", "vs_redis_unix", "vs_redis_mixed", "get_copy_gbps", "redis_get_gbps",
                "redis_unix_get_gbps", "tcp_get_gbps", "concurrent_scaling", "concurrent_get_gbps_2"):
        assert out[key] > 0, key


def test_the_engine_block_is_the_pool_page_the_connector_puts(tiny_model_dir, tiny):
    from bench.tiers.engine_block import engine_block
    from tests.fixtures_engine import make_engine

    spec = engine_block(str(tiny_model_dir))
    pool = make_engine(tiny, page_size=16).pool  # EngineConfig's default page size
    assert spec.payload_bytes == pool.bytes_per_page and spec.shape == pool.block_shape()


def _mapping_of(arr: np.ndarray) -> str:
    """The /proc/self/maps line of the mapping holding ``arr``'s first byte."""
    addr = arr.ctypes.data
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= addr < hi:
            return line
    raise AssertionError(f"no mapping holds {addr:#x}")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_cpu_baseline_copies_out_of_memory_of_the_arenas_kind():
    """The cpu ratio's baseline reads memory of the kind the tier's arena is: a memfd for the
    shared arena (not private memory, whose huge pages the memfd cannot have), private memory
    for a private arena; the bytes a baseline reads are the blocks' own, at aligned offsets."""
    from bench.tiers.run import _laid_out, baseline_memory
    from tiers.cpu import CpuTier

    with CpuTier(1 << 22) as shared, CpuTier(1 << 22, shared=False) as private:
        mem, kind = baseline_memory(shared, 1 << 21, huge_pages=False)
        assert kind == shared.page_kind
        assert "memfd:tierkv-cpu-arena" in _mapping_of(mem)
        shared.put(b"x", bytes(range(256)) * 16)
        assert "memfd:tierkv-cpu-arena" in _mapping_of(np.frombuffer(shared.get(b"x"), np.uint8))  # type: ignore[arg-type]
        pmem, pkind = baseline_memory(private, 1 << 21, huge_pages=False)
        assert pkind == private.page_kind
        assert "memfd:" not in _mapping_of(pmem)
    rng = np.random.default_rng(0)
    blocks = [(b"k%d" % i, rng.integers(0, 256, n, dtype=np.uint8)) for i, n in enumerate((100, 4096, 70))]
    srcs = _laid_out(blocks, mem)
    for k, a in blocks:
        assert np.array_equal(srcs[k], a) and (srcs[k].ctypes.data - mem.ctypes.data) % 64 == 0


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_cpu_headline_copies_out_of_private_memory_and_memfd_is_the_breakdown(monkeypatch):
    """``ratio`` is set against private memory (what a user copies from); the memfd baseline only
    gives ``vs_memfd``. Until issue 23 the headline was the memfd one."""
    import bench.tiers.run as run

    kinds: list[str] = []
    real_copy_out = run._copy_out

    def copy_out(srcs, dst):
        first = next(iter(srcs.values()))
        kinds.append("memfd" if "memfd:" in _mapping_of(first) else "private")
        return real_copy_out(srcs, dst)

    class Fake:
        def __init__(self, n: int) -> None:
            self.n = n

        def figures(self) -> dict[str, float]:
            return {"get_gbps": 1.0, "raw_gbps": 1.0, "ratio": float(self.n), "paired_ratio": float(self.n)}

    calls: list[int] = []

    def measure(tier, blocks, raw_get, reps, consume=None, extra=None):
        calls.append(len(calls))
        return Fake(len(calls) - 1)

    monkeypatch.setattr(run, "_copy_out", copy_out)
    monkeypatch.setattr(run, "measure", measure)
    out = run.bench_cpu(run.make_blocks(2), reps=1)
    assert kinds[int(out["ratio"])] == "private" and "private memory" in out["baseline"]
    assert kinds[int(out["vs_memfd"]["ratio"])] == "memfd"
    assert "vs_private_memory" not in out
