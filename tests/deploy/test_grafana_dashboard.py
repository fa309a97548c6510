"""deploy/grafana/tierkv.json: every PromQL expression names only metrics (and labels) that a real
daemon, engine, connector and CacheBlend expose, with Prometheus' suffixes (_total, _bucket).

The daemon's names come from scraping a running daemon's /metrics after some traffic (plus the
label names of its event counters that traffic did not trigger); the engine's, connector's and
CacheBlend's from their own registries (no model needed to build them)."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from tests.fixtures_kvstore import connect, fetch_one

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = json.loads((ROOT / "deploy" / "grafana" / "tierkv.json").read_text())
BUILTIN = {"up"}  # Prometheus' own series (the instance variable)
TARGET_LABELS = {"instance", "job", "le"}  # added by Prometheus to every series / every histogram bucket
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _exposed(families: list) -> dict[str, set[str]]:
    """series name -> label names, from metric families (prometheus_client's model)."""
    out: dict[str, set[str]] = {}
    for fam in families:
        labels = {k for s in fam.samples for k in s.labels} - {"le"}
        for suffix in _SUFFIXES.get(fam.type, ("",)):
            out.setdefault(fam.name + suffix, set()).update(labels)
    return out


def _registry_series(*objs: object) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for obj in objs:
        reg = obj if isinstance(obj, CollectorRegistry) else obj.registry  # type: ignore[attr-defined]
        for name, labels in _exposed(list(reg.collect())).items():
            out.setdefault(name, set()).update(labels)
        for metric in vars(obj).values() if not isinstance(obj, CollectorRegistry) else ():
            names = getattr(metric, "_labelnames", None)  # labelled metrics with no series yet
            if names is not None:
                for series in [k for k in out if k.startswith(metric._name)]:
                    out[series].update(names)
    return out


@pytest.fixture(scope="module")
def series(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    import numpy as np

    from connector.blend.metrics import BlendCollector, BlendMetrics
    from connector.metrics import ConnectorMetrics
    from engine.metrics import EngineMetrics
    from kvstore.block import encode_block
    from kvstore.config.store_config import load_config
    from kvstore.server.daemon import Daemon
    from kvstore.server.metrics import StoreMetrics

    tmp = tmp_path_factory.mktemp("grafana")
    cfg = load_config(["--cpu", "1Mi", "--disk", f"{tmp}/disk:64Mi", "--listen", "127.0.0.1:0",
                       "--metrics-listen", "127.0.0.1:0", "--stats-interval", "0"], env={})
    daemon = Daemon(cfg)
    daemon.start()
    try:
        with connect(daemon, use_shm=False) as c:  # traffic: every labelled series appears
            for i in range(4):
                key = f"grafana-key-{i:04d}".encode()
                assert c.put(key, encode_block(key, np.arange(96 * 1024, dtype="f4"), layout="T"))
            assert fetch_one(c, b"grafana-key-0000") is not None and fetch_one(c, b"grafana-absent-1") is None
        body = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=30).read().decode()
    finally:
        daemon.stop()
    out = _exposed(list(text_string_to_metric_families(body)))
    blend = CollectorRegistry()
    blend.register(BlendCollector(BlendMetrics()))
    # StoreMetrics: labels of the daemon's event counters that the traffic above did not trigger (corrupt blocks)
    for name, labels in _registry_series(StoreMetrics(), EngineMetrics(), ConnectorMetrics(), blend).items():
        out.setdefault(name, set()).update(labels)
    return out


def _expressions() -> list[tuple[str, str]]:
    exprs = [(p["title"], t["expr"]) for p in DASHBOARD["panels"] for t in p.get("targets", [])]
    exprs += [(f"variable {v['name']}", v["query"]["query"]) for v in DASHBOARD["templating"]["list"]
              if isinstance(v.get("query"), dict)]
    return exprs


def parse_promql(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) an expression uses: strings, ranges and Grafana variables removed."""
    expr = re.sub(r'"[^"]*"', '""', expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    labels = {name for sel in re.findall(r"\{([^}]*)\}", expr) for name in re.findall(r"(\w+)\s*[=!]~?", sel)}
    for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        labels |= {g.strip() for g in group.split(",") if g.strip()}
    bare = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", " ", re.sub(r"\{[^}]*\}", " ", expr))
    bare = re.sub(r"\blabel_values\(\s*(\w+)\s*,\s*\w+\s*\)", r"\1", bare)
    names = {m.group(1) for m in re.finditer(r"(?<![\w$.])([A-Za-z_:][\w:]*)\b(?!\s*\()", bare)}
    return names - KEYWORDS, labels


def test_parse_promql() -> None:
    names, labels = parse_promql('sum by (tier) (rate(tierkv_tier_hits_total{instance=~"$instance"}[$__rate_interval]))'
                                 ' / histogram_quantile(0.5, sum by (le) (rate(x_bucket[5m])))')
    assert names == {"tierkv_tier_hits_total", "x_bucket"} and labels == {"tier", "instance", "le"}


def test_dashboard_is_grafana_json() -> None:
    assert DASHBOARD["uid"] == "tierkv" and DASHBOARD["schemaVersion"] >= 36
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in DASHBOARD["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for t in p.get("targets", []):
            assert t["expr"].count("(") == t["expr"].count(")"), (p["title"], t["expr"])


@pytest.mark.parametrize("title,expr", _expressions(), ids=[f"{i}" for i in range(len(_expressions()))])
def test_every_expression_names_real_metrics(series: dict[str, set[str]], title: str, expr: str) -> None:
    names, labels = parse_promql(expr)
    assert names, (title, expr)
    for name in names - BUILTIN:
        assert name in series, f"{title}: {name} is not exported (did you mean one of " \
                               f"{sorted(n for n in series if n.split('_')[:3] == name.split('_')[:3])[:5]})"
    allowed = TARGET_LABELS.union(*(series.get(n, set()) for n in names))
    assert labels <= allowed, f"{title}: labels {sorted(labels - allowed)} not on {sorted(names)}"
