"""Prometheus metrics of one connector (own registry; the engine serves them on its /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from connector import native

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ConnectorMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.decisions = Counter("tierkv_connector_decisions", "Cost-model decisions per request",
                                 ["tier", "outcome"], registry=r)
        self.lookups = Counter("tierkv_connector_lookups", "Daemon lookups", ["result"], registry=r)
        self.loaded_tokens = Counter("tierkv_connector_loaded_tokens", "Prompt tokens whose KV was loaded",
                                     ["tier"], registry=r)
        self.load_seconds = Histogram("tierkv_connector_load_seconds", "Time of one load (lookup excluded)",
                                      buckets=_LAT, registry=r)
        self.load_failures = Counter("tierkv_connector_load_failures", "Loads cut short", ["reason"], registry=r)
        self.offload_blocks = Counter("tierkv_connector_offload_blocks", "Blocks handed to the offloader",
                                      ["result"], registry=r)  # sent | skipped_known | skipped_held | dropped | failed | refused
        self.corrupt_deleted = Counter("tierkv_connector_corrupt_blocks_deleted",
                                       "Blocks a load found corrupt, deleted from the daemon", registry=r)
        self.offload_bytes = Counter("tierkv_connector_offload_bytes", "Bytes sent to the daemon", registry=r)
        self.offload_queue_bytes = Gauge("tierkv_connector_offload_queue_bytes", "Staged bytes waiting to be sent",
                                         registry=r)
        self.prediction_error = Histogram("tierkv_connector_prediction_error_ratio",
                                          "|predicted - measured| / measured of loads",
                                          buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 5), registry=r)
        self.prefill_scale = Gauge("tierkv_connector_prefill_scale",
                                   "Measured prefill steps / the start-up prefill fit (online correction)",
                                   registry=r)
        self.prefill_scale.set(1.0)
        # loads off the engine thread (connector/fetch.py) and the load-aware decision's inputs
        self.loads_inflight = Gauge("tierkv_connector_loads_inflight", "Requests waiting in LOADING", registry=r)
        self.inflight_bytes = Gauge("tierkv_connector_inflight_bytes",
                                    "Bytes queued or moving on the transfer stream", ["tier"], registry=r)
        self.loading_seconds = Histogram("tierkv_connector_loading_seconds",
                                         "Time a request waited in LOADING (lookup, pages, transfer)",
                                         buckets=_LAT, registry=r)
        self.fetches = Counter("tierkv_connector_fetches", "Loads started at queue time, by how they ended",
                               ["result"], registry=r)  # loaded | nothing | cancelled
        self.decision_transfer_wait = Histogram(
            "tierkv_connector_decision_transfer_wait_seconds",
            "Predicted wait for the bytes already on the transfer stream, at each decision", buckets=_LAT, registry=r)
        self.decision_prefill_wait = Histogram(
            "tierkv_connector_decision_prefill_wait_seconds",
            "Predicted prefill queued ahead on the engine, at each decision", buckets=_LAT, registry=r)
        self.load_changed = Counter("tierkv_connector_load_aware_changes",
                                    "Decisions the load in flight or queued changed (idle outcome -> outcome)",
                                    ["idle", "outcome"], registry=r)
        self.native_info = native.info_gauge(r)  # tierkv_native_info{impl, reason}: which data-path ops run

    def collectors(self) -> list:
        return [self.decisions, self.lookups, self.loaded_tokens, self.load_seconds, self.load_failures,
                self.offload_blocks, self.corrupt_deleted, self.offload_bytes, self.offload_queue_bytes, self.prediction_error,
                self.prefill_scale, self.native_info, self.loads_inflight, self.inflight_bytes, self.loading_seconds,
                self.fetches, self.decision_transfer_wait, self.decision_prefill_wait, self.load_changed]

    def value(self, name: str, **labels: str) -> float:
        v = self.registry.get_sample_value(name, labels or None)
        return float(v) if v is not None else 0.0
