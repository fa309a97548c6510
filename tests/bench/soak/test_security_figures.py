"""The soak's security figures (bench/soak/security_figures.py) and their targets (bench/run_all.py)
on made-up records: each figure counts what it should, and each can fail."""

from __future__ import annotations

import grpc
import pytest

from bench.run_all import BENCHES, lookup, verdict
from bench.soak.cluster import parse_corrupt
from bench.soak.forge import forge
from bench.soak.load import Answer
from bench.soak.security_figures import (
    MISSED,
    READ,
    REFUSED,
    UNCLEAR,
    Attempt,
    Forgery,
    auth_refused,
    cross_tenant,
    dos_figures,
    dos_repeated,
    engine_attempt,
    forged_figures,
    gaps_in,
    grpc_outcome,
    health_in,
    p99,
    reclaim_seconds,
)


def test_only_permission_denied_and_unauthenticated_are_refusals() -> None:
    assert grpc_outcome(grpc.StatusCode.PERMISSION_DENIED) == REFUSED
    assert grpc_outcome(grpc.StatusCode.UNAUTHENTICATED) == REFUSED
    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE,
                 grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNKNOWN):
        assert grpc_outcome(code) == UNCLEAR, code
        assert not auth_refused(code), code
    assert auth_refused(grpc.StatusCode.UNAUTHENTICATED) and not auth_refused(None)  # None: it was served


def test_an_engine_answer_is_a_read_by_any_sign_of_reuse_not_only_cached_tokens() -> None:
    cold = Answer("p", "tenant-b", "a", cached=0, sources={"radix": 0, "daemon": 0}, pages={"absent": 11, "tail": 1})
    assert engine_attempt(cold).outcome == MISSED
    hits = [Answer("p", "b", "a", cached=16),
            Answer("p", "b", "a", cached=0, sources={"daemon": 64}),  # cached_tokens under-reported
            Answer("p", "b", "a", cached=0, pages={"loaded": 2, "absent": 9}),
            Answer("p", "b", "a", cached=0, pages={"radix": 1})]  # fmt: skip
    assert [engine_attempt(a).outcome for a in hits] == [READ] * 4
    assert engine_attempt(Answer("p", "b", "a", error="APIConnectionError")).outcome == UNCLEAR


def test_cross_tenant_reads_count_what_was_served_by_path() -> None:
    attempts = [Attempt("grpc.Get", REFUSED), Attempt("grpc.Get", READ), Attempt("raw.Get", REFUSED),
                Attempt("shm.arena", READ), Attempt("engine", MISSED), Attempt("grpc.Lookup", UNCLEAR)]  # fmt: skip
    c = cross_tenant(attempts)
    assert (c["reads"], c["refused"], c["missed"], c["unclear"], c["attempts"]) == (2, 2, 1, 1, 6)
    assert c["by_path"]["grpc.Get"] == {REFUSED: 1, READ: 1} and c["by_path"]["shm.arena"] == {READ: 1}
    assert cross_tenant([Attempt("grpc.Get", REFUSED), Attempt("engine", MISSED)])["reads"] == 0


def test_a_forged_block_served_is_an_answer_unlike_the_reference() -> None:
    good = Forgery("redis", "unsigned", 12, "Paris.", "Paris.", 12.0, 0)
    served = Forgery("s3", "mac", 12, "Paris.", "Lyon lyon", 0.0, 12)
    never_read = Forgery("s3", "mac", 12, "Paris.", "Paris.", 0.0, 12)
    unclear = Forgery("redis", "unknown_secret", 0, None, None, None, None, "no blocks")
    f = forged_figures([good, served, never_read, unclear])
    assert (f["forged_blocks_served"], f["forged_probes_exercised"], f["forged_unclear"]) == (1, 1, 1)
    assert (f["forged_blocks_planted"], f["forged_blocks_refused"]) == (36, 12.0)
    assert forged_figures([good])["forged_blocks_served"] == 0
    assert forged_figures([never_read])["forged_probes_exercised"] == 0  # a forgery never read proves nothing


@pytest.mark.parametrize("kind", ["unsigned", "mac", "unknown_secret"])
def test_forged_blocks_have_a_valid_checksum_and_the_trailer_their_kind_says(kind: str) -> None:
    import numpy as np

    from kvstore.block import decode_block, encode_block
    from tiers.mac import BAD_TAG, TRAILER_BYTES, UNKNOWN_SECRET, UNSIGNED, BlockMac

    key = b"t\x01" + bytes(6) + bytes(range(16))
    mac = BlockMac(b"s" * 40)
    real = encode_block(key, np.linspace(-1, 1, 512, dtype=np.float32).reshape(2, 256))
    fake = forge(key, mac.seal(key, real), kind, np.random.default_rng(0))
    body, why = mac.open(key, fake)
    assert why == {"unsigned": UNSIGNED, "mac": BAD_TAG, "unknown_secret": UNKNOWN_SECRET}[kind]
    blk = decode_block(bytes(body) if kind != "unsigned" else fake)  # the checksum holds: only the MAC can tell
    assert blk.key == key and blk.shape == (2, 256)
    assert bytes(body if kind != "unsigned" else fake) != real
    assert len(fake) == len(real) + (0 if kind == "unsigned" else TRAILER_BYTES)


def _ans(times: list[float], error: str | None = None) -> Answer:
    return Answer("p", "t", "a", token_times=times, error=error)


def test_gaps_are_cut_by_time_and_a_stall_across_the_probe_counts_against_it() -> None:
    a = _ans([0.0, 0.1, 0.2, 5.0, 5.1])  # a 4.8 s stall from 0.2 to 5.0, the probe ran from 1 to 3
    assert gaps_in([a], 0.0, 1.0) == pytest.approx([0.1, 0.1])
    assert gaps_in([a], 1.0, 3.0, overlapping=True) == pytest.approx([4.8])
    assert gaps_in([a], 1.0, 3.0) == []  # only within: the stall would be lost
    assert gaps_in([_ans([0.0, 0.1], error="boom")], 0, 1) == []
    assert health_in([(0.5, 0.6, 0.1), (2.0, 7.0, 5.0), (8.0, 8.1, 0.1)], 1.0, 3.0) == [5.0]


def test_p99_needs_enough_gaps_and_takes_the_nearest_rank() -> None:
    assert p99([0.1] * 19) is None
    assert p99([0.1] * 99 + [2.0]) == 0.1
    assert p99([0.1] * 98 + [2.0, 3.0]) == 2.0


def test_dos_figures_a_slower_client_and_slow_health_miss_their_targets() -> None:
    figs = {f.path: f for f in BENCHES["soak"]}
    base = [0.05] * 100
    ok = dos_figures(base, [0.06] * 100, [0.01, 0.2], [500.0, 502.0], [503.0, 506.0])
    assert ok["itl_p99_ratio"] == pytest.approx(1.2) and ok["rss_growth_mb"] == 3.5
    bad = dos_figures(base, [0.05] * 90 + [0.2] * 10, [0.01, 1.0], [500.0] * 3, [521.0] * 3)
    assert bad["itl_p99_ratio"] == pytest.approx(4.0) and bad["health_max_s"] == 1.0 and bad["rss_growth_mb"] == 21.0
    for path, good_v, bad_v in (("dos.salts.itl_p99_ratio", ok["itl_p99_ratio"], bad["itl_p99_ratio"]),
                                ("dos.salts.health_max_s", ok["health_max_s"], bad["health_max_s"]),  # 1 s is not < 1 s
                                ("dos.salts.rss_growth_mb", ok["rss_growth_mb"], bad["rss_growth_mb"])):  # fmt: skip
        assert verdict(good_v, figs[path]) == "met" and verdict(bad_v, figs[path]) == "MISSED", path
    assert dos_figures(base, [0.1] * 5, [])["itl_p99_ratio"] is None  # too few gaps under it: missing, never met
    assert verdict(None, figs["dos.salts.itl_p99_ratio"]) == "missing"
    assert "rss_growth_mb" not in dos_figures(base, base, [0.1])


def test_dos_repeated_takes_the_median_of_its_pairs_and_pools_the_rest() -> None:
    base, slow = [0.05] * 100, [0.05] * 90 + [0.1] * 10  # ratios 1.0 and 2.0
    figs = dos_repeated([(base, base, [0.01]), (base, slow, [0.3]), (base, [0.06] * 100, [0.02])],
                        [500.0] * 3, [503.0] * 3)  # fmt: skip
    assert figs["itl_p99_ratio_runs"] == [1.0, 2.0, 1.2]
    assert figs["itl_p99_ratio"] == 1.2  # one slow pair is not the probe's figure, nor is one quiet one
    assert figs["itl_p99_ratio_pooled"] == 2.0  # 10 of the 300 gaps under are 0.1 s: the pooled p99 is one
    assert figs["itl_gaps"] == [300, 300] and figs["health_max_s"] == 0.3 and figs["health_checks"] == 3
    assert figs["rss_growth_mb"] == 3.0
    one = dos_repeated([(base, slow, [0.01])])  # one pair: what dos_figures says
    assert one["itl_p99_ratio"] == dos_figures(base, slow, [0.01])["itl_p99_ratio"] == 2.0
    # a pair with too few gaps makes the probe's figure missing, never met by leaving it out
    assert dos_repeated([(base, base, []), (base, [0.1] * 5, [])])["itl_p99_ratio"] is None
    with pytest.raises(ValueError):
        dos_repeated([])


def test_reclaim_seconds_from_the_kill_to_the_first_reading_without_the_segment() -> None:
    assert reclaim_seconds(10.0, [(9.0, True), (10.1, True), (12.5, False), (13.0, False)]) == 2.5
    assert reclaim_seconds(10.0, [(10.1, True), (70.0, True)]) is None  # never reclaimed: missing, never met
    fig = next(f for f in BENCHES["soak"] if f.path == "shm_reclaim_s")
    assert verdict(2.5, fig) == "met" and verdict(31.0, fig) == "MISSED" and verdict(None, fig) == "missing"


def test_the_new_soak_targets_are_met_by_a_good_run_and_missed_by_one_bad_value() -> None:
    good = {"cross_tenant_reads": 0, "cross_tenant_attempts": 120, "forged_blocks_served": 0,
            "forged_probes_exercised": 4, "shm_reclaim_s": 0.1,
            "dos": {p: {"itl_p99_ratio": 1.1, "health_max_s": 0.05, "rss_growth_mb": 2.0, "lookup_deadline_met": True}
                    for p in ("stop_strings", "prompt_16mib", "salts", "stalled_puts", "watch_names")}}  # fmt: skip
    bad = {"cross_tenant_reads": 1, "cross_tenant_attempts": 0, "forged_blocks_served": 1,
           "forged_probes_exercised": 0, "shm_reclaim_s": 45.0, "dos.salts.itl_p99_ratio": 1.6,
           "dos.watch_names.health_max_s": 1.2, "dos.watch_names.rss_growth_mb": 25.0,
           "dos.stalled_puts.lookup_deadline_met": False}  # fmt: skip
    new = [f for f in BENCHES["soak"] if f.path.split(".")[0] in {*good, "dos"}]
    assert len(new) == 18
    assert all(verdict(lookup(good, f.path), f) == "met" for f in new)
    for path, value in bad.items():
        assert verdict(value, next(f for f in new if f.path == path)) == "MISSED", path


def test_the_corrupt_block_counter_is_read_from_metrics() -> None:
    text = ('# HELP tierkv_tier_corrupt_blocks_total ...\n'
            'tierkv_tier_corrupt_blocks_total{reason="unsigned",tier="redis"} 14.0\n'
            'tierkv_tier_corrupt_blocks_total{reason="mac",tier="s3"} 3.0\n'
            'tierkv_tier_corrupt_blocks_created{reason="mac",tier="s3"} 1.7e9\n')  # fmt: skip
    assert parse_corrupt(text) == {("redis", "unsigned"): 14.0, ("s3", "mac"): 3.0}
