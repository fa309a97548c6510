"""The cluster bench's bookkeeping without a cluster: what a round counts, when a node has
recovered, how repeated faults are summed, a worker that hangs or dies, the CLI's refusals."""

from __future__ import annotations

import subprocess

import pytest

from bench.cluster.__main__ import main
from bench.cluster.faults import Driver, Plan, repeated
from bench.cluster.rounds import Round, summed
from bench.cluster.worker_session import WorkerSession


def _round(get: dict[str, object], put: dict[str, object] | None = None) -> Round:
    rnd = Round(1, 4)
    rnd.puts = {0: put or {"put": 4, "pending": 0}, 1: {"put": 4, "pending": 0}}
    rnd.gets = {0: [(1, get)]}
    return rnd


def test_a_whole_read_is_a_full_hit() -> None:
    rnd = _round({"hits": 4, "misses": 0, "wrong": 0, "tiers": {"redis": 3, "s3": 1}})
    assert rnd.full_hit(0) and not rnd.full_hit(1)  # node1 read nothing this round
    t = rnd.tally()
    assert (t["hits"], t["asked"], t["wrong"], t["tier_redis"], t["tier_s3"], t["client_errors"]) == (4, 4, 0, 3, 1, 0)


@pytest.mark.parametrize("get,put", [
    ({"hits": 4, "misses": 0, "wrong": 1, "tiers": {}}, None),  # other bytes: never a hit that counts
    ({"hits": 3, "misses": 1, "wrong": 0, "tiers": {}}, None),  # a miss
    ({"s": 10.0, "error": "KVStoreTimeout: deadline"}, None),  # the client raised
    ({"hits": 4, "misses": 0, "wrong": 0, "tiers": {}}, {"s": 1.0, "error": "KVStoreUnavailable: down"}),
])
def test_wrong_missing_or_failed_is_not_recovered(get: dict[str, object], put: dict[str, object] | None) -> None:
    assert not _round(get, put).full_hit(0)


def test_wrong_blocks_and_errors_are_counted() -> None:
    rounds = [_round({"hits": 4, "misses": 0, "wrong": 2, "tiers": {}}), _round({"s": 1.0, "error": "X: y"})]
    t = summed(rounds)
    assert t["wrong"] == 2 and t["client_errors"] == 1 and t["asked"] == 4 and t["requests"] == 6


def test_repeated_faults_sum_counts_and_take_the_median() -> None:
    results = iter([
        {"wrong_outputs": 0, "client_errors": 1, "requests": 10, "unavailable": 0, "hits": 8, "asked": 8,
         "puts_not_landed": 0, "recovery_s": 3.0, "recovered": True, "rounds_to_recover": 1, "round_s": 0.5},
        {"wrong_outputs": 1, "client_errors": 0, "requests": 10, "unavailable": 2, "hits": 6, "asked": 8,
         "puts_not_landed": 1, "recovery_s": 1.0, "recovered": True, "rounds_to_recover": 2, "round_s": 0.9},
        {"wrong_outputs": 0, "client_errors": 0, "requests": 10, "unavailable": 0, "hits": 8, "asked": 8,
         "puts_not_landed": 0, "recovery_s": 2.0, "recovered": True, "rounds_to_recover": 1, "round_s": 0.4}])
    d = Driver(None, Plan(repeats=3))  # type: ignore[arg-type]
    out = repeated(lambda _: next(results), d)
    assert out["wrong_outputs"] == 1 and out["client_errors"] == 1 and out["unavailable"] == 2
    assert out["recovery_s"] == 2.0 and out["recovery_s_runs"] == [3.0, 1.0, 2.0] and out["rounds_to_recover"] == 2
    assert out["round_s"] == 0.9 and len(out["runs"]) == 3  # type: ignore[arg-type]

    lost = iter([{"others_hit_rate_during": 1.0, "promoted_s": 3.0}, {"others_hit_rate_during": 0.5, "promoted_s": 1.0},
                 {"others_hit_rate_during": 1.0, "promoted_s": None}])
    base = {"wrong_outputs": 0, "client_errors": 0, "requests": 1, "unavailable": 0, "hits": 1, "asked": 1,
            "puts_not_landed": 0, "recovery_s": 1.0, "recovered": True, "rounds_to_recover": 1, "round_s": 1.0}
    out = repeated(lambda _: {**base, **next(lost)}, d)
    assert out["others_hit_rate_during"] == 0.5  # the worst run's share, never the best
    assert out["promoted_s"] is None and out["promoted_s_runs"] == [3.0, 1.0, None]  # one run never promoted

    never = {"wrong_outputs": 0, "client_errors": 0, "requests": 1, "unavailable": 0, "hits": 0, "asked": 1,
             "puts_not_landed": 0, "recovery_s": None, "recovered": False, "rounds_to_recover": None, "round_s": 1.0}
    out = repeated(lambda _: dict(never), Driver(None, Plan(repeats=2)))  # type: ignore[arg-type]
    assert out["recovery_s"] is None and out["recovered"] is False and out["rounds_to_recover"] is None


def _session(argv: list[str]) -> WorkerSession:
    return WorkerSession(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))


def test_a_worker_that_does_not_answer_times_out_and_is_killed() -> None:
    w = _session(["sleep", "30"])
    w.send("get", "t", 4)
    got = w.receive(0.3)
    assert str(got["error"]).startswith("WorkerTimeout") and w.proc.wait(5) is not None
    assert str(w.receive(0.3)["error"]).startswith("WorkerGone")  # never waits on it again
    w.close()


def test_a_worker_that_ended_is_gone_not_a_hang() -> None:
    w = _session(["true"])
    w.proc.wait(5)
    w.send("put", "t", 4)
    assert str(w.receive(5)["error"]).startswith("WorkerGone")
    w.close()


@pytest.mark.parametrize("argv", [["--nodes", "2"], ["--faults", "node_lost,meteor"]])
def test_the_cli_refuses_fewer_than_three_nodes_and_unknown_faults(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv)


def test_no_namespaces_is_said_plainly_not_a_traceback(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    import bench.cluster.__main__ as cli
    from bench.cluster.topology import NamespacesUnavailable

    def refuse(*args: object, **kw: object) -> None:
        raise NamespacesUnavailable("network namespaces need root")

    monkeypatch.setattr(cli, "run", refuse)
    assert cli.main(["--quick"]) == 2
    assert "needs network namespaces: network namespaces need root" in capsys.readouterr().err
