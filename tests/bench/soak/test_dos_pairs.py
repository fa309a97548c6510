"""bench/soak/dos.py: each probe as pairs of windows, a counted probe's count split over them."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from bench.soak.dos import PROBES, DosProbes


def _probes(pairs: int) -> DosProbes:
    cluster = SimpleNamespace(creds=SimpleNamespace(api={"tenant-c": "key"}))
    return DosProbes(cluster, SimpleNamespace(clock=time.monotonic), "m", window_s=0.0, salts=10, watch_names=7,  # type: ignore[arg-type]
                     pairs=pairs)  # fmt: skip


def test_each_probe_runs_in_pairs_and_a_count_is_sent_once_over_them(monkeypatch: pytest.MonkeyPatch) -> None:
    d = _probes(3)
    sent: dict[str, list[int]] = {}
    rss = iter(range(1000))

    def probe(name: str, n: int) -> Any:
        def run(stop: Any, detail: dict[str, Any]) -> None:
            ids = list(d._share(n))
            sent.setdefault(name, []).extend(ids)
            detail["ids"] = ids
        return run

    for name in PROBES:
        monkeypatch.setattr(d, name, probe(name, {"salts": 10, "watch_names": 7}.get(name, 0)))
    monkeypatch.setattr(d, "_rss_of", lambda name: [float(next(rss))])
    windows = d.run()
    assert [w["probe"] for w in windows] == list(PROBES)
    for w in windows:
        assert len(w["pairs"]) == 3
        spans = [t for p in w["pairs"] for t in (*p["base"], *p["under"])]
        assert spans == sorted(spans)  # base then under, pair after pair
        assert w["rss_before"][0] < w["rss_after"][0]  # before the first probe window, after the last
    assert sent["salts"] == list(range(10)) and sent["watch_names"] == list(range(7))  # each once, in all
    assert [len(p["detail"]["ids"]) for p in windows[PROBES.index("salts")]["pairs"]] == [3, 3, 4]


def test_one_pair_sends_the_whole_count_and_no_pairs_is_refused() -> None:
    d = _probes(1)
    assert d._share(10_000) == range(10_000)
    with pytest.raises(ValueError):
        _probes(0)
