"""``TierKVConnector``: tierkv behind vLLM's KV connector API (v1), out of tree.

    python -m vllm.entrypoints.openai.api_server --model DIR --kv-transfer-config \\
      '{"kv_connector": "TierKVConnector", "kv_connector_module_path": "connector.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kvstore": "127.0.0.1:50051"}}'

vLLM builds one instance per role. The scheduler's (planner.py) answers "how many tokens beyond
your local prefix hit does the daemon hold, and is loading them worth it", and plans each step's
loads and write-through saves; the worker's (worker.py) moves the bytes. This file only
translates vLLM's objects into those two and refuses, at start-up and in one line, what it cannot
serve correctly: a load failure policy other than "recompute" (a daemon that fails mid-load must
mean recompute, never a failed request), tensor or pipeline parallelism (each rank would need its
own shard of a block), and a model with more than one KV cache group.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from connector.vllm.config import ConnectorConfigError, VLLMConnectorConfig
from connector.vllm.counters import Counters
from connector.vllm.keys import VLLMKeySpace, weights_digest
from connector.vllm.meta import TierKVMetadata
from connector.vllm.planner import Planner, Scheduled
from connector.vllm.stats import TierKVPromMetrics, TierKVStats
from connector.vllm.worker import BlockLayout, Worker
from kvstore.client.client import KVStoreClient
from kvstore.client.retry import Retry
from kvstore.server.auth import ClientAuth

if TYPE_CHECKING:
    import torch

log = logging.getLogger("tierkv.vllm")

#: config fields that change the KV a model computes for the same tokens (the key namespace)
ARCH_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
               "head_dim", "vocab_size", "rope_theta", "rope_scaling", "rope_parameters", "sliding_window",
               "quantization_config")  # fmt: skip


def _spec(kv_cache_config: Any) -> Any:
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) != 1:
        raise ConnectorConfigError(f"tierkv serves models with one KV cache group, this one has {len(groups)}")
    return groups[0].kv_cache_spec


def key_space(vllm_config: Any, kv_cache_config: Any, cfg: VLLMConnectorConfig) -> VLLMKeySpace:
    """The namespace both roles compute alike: the model, the KV dtype, the block size, the device
    and the attention layout, so blocks are shared exactly when they are interchangeable."""
    mc = vllm_config.model_config
    hf = mc.hf_config.to_dict() if hasattr(mc.hf_config, "to_dict") else dict(vars(mc.hf_config))
    text = hf.get("text_config") or {}
    arch = {k: hf.get(k, text.get(k)) for k in ARCH_FIELDS}
    arch["dtype"] = str(mc.dtype)
    if cfg.model_fingerprint:
        weights = cfg.model_fingerprint
    elif Path(str(mc.model)).is_dir():
        weights = weights_digest(mc.model)
    else:  # a hub name: its revision is the best identity there is
        weights = f"{mc.model}@{getattr(mc, 'revision', None) or 'main'}"
    spec = _spec(kv_cache_config)
    device = str(getattr(vllm_config.device_config, "device_type", "cpu") or "cpu")
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    layout = (f"{device}:{type(spec).__name__}:{spec.num_kv_heads}x{spec.head_size}:"
              f"{getattr(spec, 'head_size_v', spec.head_size)}:{backend or 'auto'}")  # fmt: skip
    return VLLMKeySpace(arch, weights, str(spec.dtype), int(spec.block_size), layout, tenant=cfg.tenant)


def _client(cfg: VLLMConnectorConfig, deadline_s: float, use_shm: bool | None) -> KVStoreClient:
    auth = ClientAuth.from_env(token_file=cfg.token_file, tls_ca=cfg.tls_ca)
    return KVStoreClient(cfg.kvstore, deadline_s=deadline_s, retry=Retry(attempts=1), use_shm=use_shm, auth=auth)


class TierKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self.cfg = VLLMConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        policy = getattr(ktc, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            raise ConnectorConfigError(f"TierKVConnector needs \"kv_load_failure_policy\": \"recompute\" in "
                                       f"--kv-transfer-config (got {policy!r}): a block the daemon cannot serve "
                                       "must be recomputed, not fail the request")  # fmt: skip
        pc = vllm_config.parallel_config
        if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
            raise ConnectorConfigError(f"TierKVConnector supports one rank (tensor_parallel_size=1, "
                                       f"pipeline_parallel_size=1), got {pc.tensor_parallel_size}x"
                                       f"{pc.pipeline_parallel_size}")  # fmt: skip
        self.space = key_space(vllm_config, kv_cache_config, self.cfg)
        self.counters = Counters()
        self.num_blocks = getattr(kv_cache_config, "num_blocks", None)
        self.planner: Planner | None = None
        self.worker: Worker | None = None
        self._clients: list[KVStoreClient] = []
        if role == KVConnectorRole.SCHEDULER:
            spec = _spec(kv_cache_config)
            block_bytes = int(spec.page_size_bytes) * int(vllm_config.model_config.get_num_layers(
                vllm_config.parallel_config))  # fmt: skip
            client = _client(self.cfg, self.cfg.lookup_deadline_s, use_shm=False)
            self._clients.append(client)

            def lookup(keys: Any, deadline_s: float) -> tuple[int, list[str | None]]:
                r = client.lookup(keys, read=True, deadline_s=deadline_s)
                return r.prefix_len, r.tiers

            self.planner = Planner(self.cfg, self.space, lookup, block_bytes, self.counters)
        log.info("tierkv: %s connector for daemon %s (block %d tokens, layout %s)", role.name.lower(),
                 self.cfg.kvstore, self.space.block_size, self.space.layout)

    # ==== worker side =========================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = BlockLayout(kv_caches, self.num_blocks)
        load = _client(self.cfg, self.cfg.load_deadline_s, self.cfg.use_shm)
        save = _client(self.cfg, max(self.cfg.load_deadline_s, 10.0), self.cfg.use_shm)
        self._clients += [load, save]
        self.worker = Worker(
            layout,
            read=lambda keys, consume, dl: load.read_batches(keys, consume, deadline_s=dl),
            delete=load.delete,
            held=lambda keys: save.lookup(keys, read=False).tiers,
            put=save.put_many,
            counters=self.counters,
            save_queue_bytes=self.cfg.save_queue_bytes,
        )  # fmt: skip
        log.info("tierkv: %d layers, block %s %s (%d bytes), layout %s", len(layout.tensors), layout.block_shape,
                 layout.dtype, layout.block_bytes, layout.layout)

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, TierKVMetadata):
            self.worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.start_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # in-step loads are done when start_load_kv returns; the others are asynchronous

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saves are gathered once, after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.after_forward()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        done = self.worker.finished()
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors() if self.worker is not None else set()

    def build_connector_worker_meta(self) -> Any:
        return self.worker.worker_meta() if self.worker is not None else None

    def get_kv_connector_stats(self) -> TierKVStats | None:
        data = self.counters.take()
        return TierKVStats(data=data) if any(data.values()) else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        for c in self._clients:
            try:
                c.close()
            except Exception:  # noqa: BLE001, S110 - closing on the way out
                pass
        self._clients = []

    # ==== scheduler side ======================================================================
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.planner is not None
        return self.planner.matched(request.request_id, request.all_token_ids, request.num_prompt_tokens,
                                    getattr(request, "cache_salt", None), num_computed_tokens)  # fmt: skip

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self.planner is not None
        ids = blocks.get_block_ids()
        self.planner.allocated(request.request_id, ids[0] if ids else [], num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> TierKVMetadata:
        assert self.planner is not None
        n = scheduler_output.num_scheduled_tokens
        rows: list[Scheduled] = []
        for r in scheduler_output.scheduled_new_reqs:
            rows.append(Scheduled(r.req_id, r.num_computed_tokens, n.get(r.req_id, 0), r.block_ids[0], True))
        c = scheduler_output.scheduled_cached_reqs
        resumed = getattr(c, "resumed_req_ids", set()) or set()
        for i, req_id in enumerate(c.req_ids):
            new = c.new_block_ids[i]
            rows.append(Scheduled(req_id, c.num_computed_tokens[i], n.get(req_id, 0),
                                  None if new is None else new[0], req_id in resumed))  # fmt: skip
        return self.planner.build(rows)

    def update_connector_output(self, connector_output: Any) -> None:
        if self.planner is not None:
            self.planner.report(getattr(connector_output, "kv_connector_worker_meta", None))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.planner is not None:
            self.planner.finished(request.request_id)
        return False, None

    # ==== stats ===============================================================================
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> TierKVStats:
        return TierKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> TierKVPromMetrics:  # fmt: skip
        return TierKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
