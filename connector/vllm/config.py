"""The vLLM connector's one frozen configuration, read from ``kv_connector_extra_config``.

vLLM hands every out-of-tree connector the JSON object given as ``kv_connector_extra_config`` in
``--kv-transfer-config``. Only ``kvstore`` (the daemon's HOST:PORT) is required; every other key
has a default, and an unknown key or a value of the wrong type is refused at start-up with one
line naming it, so a typo never silently turns a feature off.

=====================  =========  =============================================================
key                    default    meaning
=====================  =========  =============================================================
kvstore                (required) the daemon's gRPC address, HOST:PORT
token_file             ""         the daemon's bearer-token file ("" = TIERKV_TOKEN /
                                  TIERKV_TOKEN_FILE / the default token file, kvstore/server/auth.py)
tenant                 ""         the tenant this vLLM deployment serves (one deployment = one
                                  tenant): its blocks are tagged with this name, and vLLM's
                                  per-request cache_salt only sub-divides it. The daemon credential
                                  (token_file) must list it, else every lookup and save is refused
                                  (PERMISSION_DENIED: counted, recomputed). "" = legacy: the
                                  cache_salt alone is the tenant (an admin credential's daemon)
tls_ca                 ""         CA of the daemon's TLS certificate ("" = TIERKV_TLS_CA or none)
lookup_deadline_s      0.25       one Lookup on the scheduler's path; past it: recompute
load_deadline_s        10.0       the most one request's load may take (then: recompute the rest)
load_deadline_factor   4.0        ... or this many times the predicted load, if more than the min
load_deadline_min_s    1.0        a load's deadline is at least this
load_mode              "auto"     auto (cost model) | always (load what is held) | never
sync_load_max_s        0.05       a load predicted to take at most this long runs inside the step
                                  that schedules the request (vLLM waits for it before the forward;
                                  its deadline is sync_load_deadline_s); longer ones run
                                  asynchronously. An async load waits two engine steps (it starts at
                                  the next step, is reported at that step's end), which under load
                                  is far longer than a small load from a local tier. 0 = never
sync_load_deadline_s   0.2        the most an in-step load may stall the step (then: recompute)
min_prefill_samples    4          timed prefill steps before the cost model's prefill fit decides;
                                  until then every held block is loaded (outcome "uncalibrated")
save                   true       write full blocks through to the daemon
save_queue_bytes       268435456  gathered blocks waiting to be sent; beyond: dropped, counted
known_keys             65536      keys remembered as held by the daemon (no re-save, no re-ask)
retry_after_failure_s  5.0        after the daemon failed a lookup, skip lookups this long
use_shm                null       same-host shared memory (null = when the daemon offers it)
model_fingerprint      ""         override the weights digest that namespaces the keys
=====================  =========  =============================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvstore.errors import KVStoreError
from kvstore.keys import check_tenant_name


class ConnectorConfigError(KVStoreError, ValueError):
    """A ``kv_connector_extra_config`` that cannot be used (one line, naming the key)."""


LOAD_MODES = ("auto", "always", "never")


@dataclass(frozen=True)
class VLLMConnectorConfig:
    kvstore: str
    token_file: str = ""
    tenant: str = ""
    tls_ca: str = ""
    lookup_deadline_s: float = 0.25
    load_deadline_s: float = 10.0
    load_deadline_factor: float = 4.0
    load_deadline_min_s: float = 1.0
    load_mode: str = "auto"
    sync_load_max_s: float = 0.05
    sync_load_deadline_s: float = 0.2
    min_prefill_samples: int = 4
    save: bool = True
    save_queue_bytes: int = 256 * 1024**2
    known_keys: int = 65536
    retry_after_failure_s: float = 5.0
    use_shm: bool | None = None
    model_fingerprint: str = ""

    def __post_init__(self) -> None:
        host, sep, port = self.kvstore.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConnectorConfigError(f"kvstore must be HOST:PORT, got {self.kvstore!r}")
        for name in ("lookup_deadline_s", "load_deadline_s", "load_deadline_factor", "load_deadline_min_s",
                     "sync_load_deadline_s"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ConnectorConfigError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.load_mode not in LOAD_MODES:
            raise ConnectorConfigError(f"load_mode must be one of {', '.join(LOAD_MODES)}, got {self.load_mode!r}")
        for name in ("min_prefill_samples", "save_queue_bytes", "known_keys"):
            if getattr(self, name) < 0:
                raise ConnectorConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.sync_load_max_s < 0:
            raise ConnectorConfigError(f"sync_load_max_s must be >= 0, got {self.sync_load_max_s!r}")
        if self.retry_after_failure_s < 0:
            raise ConnectorConfigError(f"retry_after_failure_s must be >= 0, got {self.retry_after_failure_s!r}")
        if self.tenant:
            try:
                check_tenant_name(self.tenant, "kv_connector_extra_config 'tenant'")
            except ValueError as e:
                raise ConnectorConfigError(str(e)) from None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> VLLMConnectorConfig:
        """Build from vLLM's ``kv_connector_extra_config``; refuses unknown keys and wrong types."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConnectorConfigError(f"unknown kv_connector_extra_config key(s) {', '.join(unknown)}; "
                                       f"known: {', '.join(known)}")
        if "kvstore" not in extra:
            raise ConnectorConfigError("kv_connector_extra_config needs \"kvstore\": \"HOST:PORT\" (the daemon)")
        kw: dict[str, Any] = {}
        for name, value in extra.items():
            kw[name] = _typed(name, known[name].type, value)
        return cls(**kw)


def _typed(name: str, kind: Any, value: Any) -> Any:
    kind = str(kind)
    if kind == "bool | None":
        if value is None or isinstance(value, bool):
            return value
    elif kind == "bool":
        if isinstance(value, bool):
            return value
    elif kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind == "float":
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    elif kind == "str":
        if isinstance(value, str):
            return value
    raise ConnectorConfigError(f"kv_connector_extra_config {name!r} must be {kind}, got {value!r}")
