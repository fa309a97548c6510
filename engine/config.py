"""One frozen configuration object for an engine process, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.core_load import QUIET_WAIT_S
from engine.env import EnvDeclaration, parse_size

ENV_PREFIX = "TIERKV_ENGINE_"  # TIERKV_ENGINE_<FIELD> sets a field (a flag overrides it)


@dataclass(frozen=True)
class EngineConfig:
    model: str = ""  # "" = the bundled SmolLM2-135M-Instruct; else a local HF dir or a .gguf file
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16 | float16
    page_size: int = 16
    kv_memory: int = 512 * 2**20  # bytes for the paged KV pool (sizes: 512Mi = 512 x 2^20, 512M = 512 x 10^6)
    num_pages: int = 0  # overrides kv_memory when > 0 (tests)
    max_num_seqs: int = 64  # running requests at once
    # prompt tokens one step may add to its decodes (chunked prefill): small keeps streams flowing behind
    # long prompts (bench/results/serve_prefill_sweep_quick.json, docs/operations.md); raise it on a GPU
    max_prefill_tokens: int = 128
    # of those, prompts of tenants other than one decoding in the step may add at most this share of a
    # decode-only step to it (learnt from the engine's steps): what another tenant's load adds to a
    # stream's gap between tokens (engine/step_budget.py; only with several tenants); 0 = no bound.
    # A quarter: under another tenant's flood the stream's steps then take ~1.13-1.2x a decode-only one
    # at the median, leaving its tail room under 1.5x (docs/operations.md, "Other tenants' prompts")
    cross_tenant_step_share: float = 0.25
    max_model_len: int = 0  # 0 = the model's max_position_embeddings
    attention_backend: str = "auto"  # auto | torch | flashinfer
    num_threads: int = 0  # torch intra-op threads on CPU; 0 = leave torch's default
    # linear layers of small steps on the CPU: auto = the fastest of the native form (csrc/gemm.c), the
    # mm form and F.linear at each step size, timed at start-up (engine/cpu_gemm.py) | torch = the same
    # without the native form | linear = F.linear always
    cpu_gemm: str = "auto"
    # the most that choice waits, all told, for other processes to leave the cores it is timed on
    # (engines started together time against each other: engine/cpu_gemm.py); 0: never waits
    cpu_gemm_quiet_wait_s: float = QUIET_WAIT_S
    seed: int = 0
    served_model_name: str = ""
    kvstore: str = ""  # kvstore daemon HOST:PORT to attach the connector to ("" = none)
    kv_connector: str = "tierkv"  # which registered connector --kvstore attaches (engine/plugins.py)
    shared_prefix_file: str = ""  # YAML list of prompts every tenant shares the KV of (engine/shared_prefix.py)
    tenant: str = ""  # the one tenant of an engine without API keys: every request's namespace (engine/tenancy.py)
    api_keys_file: str = ""  # YAML API key -> tenant: /v1/* need a key, whose tenant is the request's (engine/tenancy.py)
    # what one API client may ask (engine/limits.py): past a bound, a 400 (429 for max_waiting)
    max_waiting: int = 256  # API requests in flight beyond max_num_seqs (tokenising or queued)
    # of those, what one tenant may hold; 0 = half of them with API keys (several tenants), all without
    max_tenant_in_flight: int = 0
    max_stop_strings: int = 8
    max_stop_chars: int = 256  # characters of one stop string
    max_stop_token_ids: int = 64
    max_prompt_chars: int = 0  # characters of a text prompt before tokenising; 0 = 16 per token of context
    max_body_bytes: int = 0  # bytes of one request body; 0 = 128 per token of context, at least 1 MiB
    max_salt_bytes: int = 256  # UTF-8 bytes of a cache_salt

    def __post_init__(self) -> None:
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.kv_memory <= 0 and self.num_pages <= 0:
            raise ValueError("kv_memory or num_pages must be > 0")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be > 0")
        if self.max_prefill_tokens < self.page_size:
            raise ValueError("max_prefill_tokens must be >= page_size")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"unknown device {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        if self.cpu_gemm not in ("auto", "torch", "linear"):
            raise ValueError(f"unknown cpu_gemm {self.cpu_gemm!r} (auto, torch or linear)")
        if self.cpu_gemm_quiet_wait_s < 0:
            raise ValueError(f"cpu_gemm_quiet_wait_s must be >= 0, got {self.cpu_gemm_quiet_wait_s}")
        if self.attention_backend not in ("auto", "torch", "flashinfer"):
            raise ValueError(f"unknown attention backend {self.attention_backend!r}")
        if self.tenant:
            from engine.tenancy import check_tenant

            check_tenant(self.tenant, "tenant")
            if self.api_keys_file:
                raise ValueError("tenant names the one tenant of an engine without API keys; with api_keys_file "
                                 "each key names its tenant")
        if not 0 <= self.cross_tenant_step_share < math.inf:
            raise ValueError(f"cross_tenant_step_share must be >= 0, got {self.cross_tenant_step_share}")
        for name in ("max_waiting", "max_tenant_in_flight", "max_stop_strings", "max_stop_token_ids", "max_prompt_chars", "max_body_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_stop_chars", "max_salt_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @staticmethod
    def from_env(**overrides: object) -> EngineConfig:
        """Defaults < TIERKV_ENGINE_* environment < explicit overrides (CLI flags)."""
        env = ENV.overrides()
        env.update({k: v for k, v in overrides.items() if v is not None})
        if isinstance(env.get("kv_memory"), str):
            env["kv_memory"] = parse_size(env["kv_memory"])  # type: ignore[arg-type]
        return EngineConfig(**env)  # type: ignore[arg-type]


ENV = EnvDeclaration(ENV_PREFIX, EngineConfig)  # the variables the engine itself reads
