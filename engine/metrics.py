"""Prometheus metrics of one engine process (own registry: no globals, several engines per test)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine.request import PromptUsage

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class EngineMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("tierkv_engine_ttft_seconds", "Time to first token", buckets=_LAT, registry=r)
        self.tpot = Histogram("tierkv_engine_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=_TPOT, registry=r)
        self.e2e = Histogram("tierkv_engine_request_latency_seconds", "End-to-end request latency",
                             buckets=_LAT, registry=r)
        self.queue_depth = Gauge("tierkv_engine_queue_depth", "Requests waiting to be scheduled", registry=r)
        self.running = Gauge("tierkv_engine_running_requests", "Requests running", registry=r)
        self.kv_usage = Gauge("tierkv_engine_kv_pool_usage_ratio", "Share of KV pool pages in use", registry=r)
        self.kv_pages = Gauge("tierkv_engine_kv_pool_pages", "KV pool pages in total", registry=r)
        self.prompt_tokens = Counter("tierkv_engine_prompt_tokens", "Prompt tokens received", registry=r)
        self.prefix_hit_tokens = Counter("tierkv_engine_prefix_hit_tokens",
                                         "Prompt tokens whose KV was not computed for the request (cached_tokens)",
                                         registry=r)
        self.prompt_kv_tokens = Counter("tierkv_engine_prompt_kv_tokens",
                                        "Prompt tokens by where their KV came from (outcome cached|computed)",
                                        ["outcome", "source"], registry=r)
        self.prompt_pages = Counter("tierkv_engine_prompt_pages",
                                    "Prompt pages by cache outcome (reason: radix, loaded, read_failed, bypassed, "
                                    "after_gap, evicted, absent, unavailable, tail) and daemon tier",
                                    ["reason", "tier"], registry=r)
        self.generation_tokens = Counter("tierkv_engine_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("tierkv_engine_requests", "Finished requests", ["finish_reason"], registry=r)
        self.preemptions = Gauge("tierkv_engine_preemptions", "Preemptions so far", registry=r)
        self.api_in_flight = Gauge("tierkv_engine_api_requests_in_flight",
                                   "API requests accepted and not finished (tokenising, queued or running)", registry=r)
        self.api_tokenizing = Gauge("tierkv_engine_api_prompts_tokenizing",
                                    "Prompts being tokenised, on the thread pool beside the event loop", registry=r)
        self.api_overloaded = Counter("tierkv_engine_api_overloaded", "API requests refused with 429: too many in "
                                      "flight (max_num_seqs + max_waiting)", registry=r)

    def count_usage(self, usage: PromptUsage) -> None:
        for outcome, parts in (("cached", usage.cached_by_source()), ("computed", usage.computed_by_source())):
            for source, n in parts.items():
                self.prompt_kv_tokens.labels(outcome, source).inc(n)
        for p in usage.pages:
            self.prompt_pages.labels(p.reason, p.tier or "none").inc(p.pages)

    def render(self) -> bytes:
        return generate_latest(self.registry)
