"""The connector's counters on vLLM's own logs and /metrics.

vLLM collects ``get_kv_connector_stats()`` from the worker and from the scheduler every step,
``aggregate``s them, and hands the sum (``to_dict()``) to its stat loggers: the periodic log line
("KV Transfer metrics: ...", from ``reduce``) and the Prometheus logger, which calls
``TierKVPromMetrics.observe`` in the API server process. Each sample is a dict of counter deltas
keyed as connector/vllm/counters.py lists them; here they become counters named
``tierkv_connector_vllm_*`` on vLLM's /metrics, beside vLLM's own, with vLLM's labels (model
name, engine index) and one label of ours where a key has one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
except ImportError:  # pragma: no cover - the unit tests run without vLLM
    from dataclasses import field

    @dataclass
    class KVConnectorStats:  # type: ignore[no-redef]
        data: dict[str, Any] = field(default_factory=dict)

    class KVConnectorPromMetrics:  # type: ignore[no-redef]
        def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:  # noqa: ANN001
            from prometheus_client import Counter, Gauge, Histogram

            self._counter_cls = metric_types[Counter]
            self._gauge_cls, self._histogram_cls = metric_types.get(Gauge), metric_types.get(Histogram)
            self._labelnames = labelnames
            self.per_engine_labelvalues = per_engine_labelvalues


@dataclass
class TierKVStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> TierKVStats:
        out = dict(self.data)
        for k, v in (other.data or {}).items():
            out[k] = out.get(k, 0) + v
        return TierKVStats(data=out)

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {}
        for k in ("blocks:looked_up", "blocks:held", "blocks:loaded", "blocks:saved", "blocks:save_dropped"):
            if d.get(k):
                out[k.split(":", 1)[1]] = int(d[k])
        failed = sum(v for k, v in d.items() if k.startswith("failed:"))
        if failed:
            out["failed_blocks"] = int(failed)
        if d.get("loads"):
            out["load_ms_avg"] = round(1000 * d.get("load_seconds", 0.0) / d["loads"], 2)
            if d.get("load_seconds"):
                out["load_GBps"] = round(d.get("bytes:loaded", 0) / d["load_seconds"] / 1e9, 3)
        if d.get("lookup_errors"):
            out["lookup_errors"] = int(d["lookup_errors"])
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


#: key (or key prefix before ":") -> (metric suffix, documentation, label name or "")
METRICS: dict[str, tuple[str, str, str]] = {
    "blocks": ("blocks_total", "Blocks per event: looked_up, held, loaded, saved, save_skipped, save_dropped", "event"),
    "failed": ("failed_blocks_total", "Blocks a load gave back to vLLM to recompute, by reason", "reason"),
    "bytes": ("bytes_total", "Block bytes moved: loaded, saved, read", "direction"),
    "decisions": ("decisions_total", "Cost-model decisions per request, by outcome", "outcome"),
    "loads": ("loads_total", "Loads finished (whole or in part)", ""),
    "load_seconds": ("load_seconds_total", "Seconds spent in loads (lookups excluded)", ""),
    "sync_loads": ("sync_loads_total", "Of the loads, those run inside the step (the rest asynchronously)", ""),
    "lookup_errors": ("lookup_errors_total", "Lookups that failed (the request recomputed)", ""),
    "lookup_skipped": ("lookup_skipped_total", "Lookups skipped after a recent failure", ""),
}
PREFIX = "tierkv_connector_vllm_"


class TierKVPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:  # fmt: skip
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics = {}
        for key, (suffix, doc, label) in METRICS.items():
            names = list(labelnames) + ([label] if label else [])
            self._metrics[key] = self._counter_cls(name=PREFIX + suffix, documentation=doc, labelnames=names)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        base = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for k, v in (transfer_stats_data or {}).items():
            if not v or v < 0:
                continue
            head, _, label = k.partition(":")
            metric = self._metrics.get(head)
            if metric is None:
                continue
            metric.labels(*base, *([label] if label else [])).inc(v)
