"""The connector's one frozen configuration object, validated on construction, and the environment
variables it reads (``ENV``: what kvengine and the daemon judge ``TIERKV_CONNECTOR_*`` by)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core_load import QUIET_WAIT_S
from engine.env import EnvDeclaration
from kvstore.keys import check_tenant_name

LOAD_MODES = ("auto", "always", "never")
CALIBRATION_ENV = "TIERKV_CONNECTOR_CALIBRATION"  # part of the prefill model's cache key (connector/calibrate.py)


@dataclass(frozen=True)
class ConnectorConfig:
    address: str  # kvstore daemon HOST:PORT
    load_mode: str = "auto"  # auto = the cost model decides; always = load every hit; never = always recompute
    write_through: bool = False  # also offload a request's full pages when it finishes
    offload_on_evict: bool = True  # offload radix leaves as they are evicted
    lookup_deadline_s: float = 0.25  # one Lookup RPC
    load_deadline_min_s: float = 0.5  # a load may take max(this, factor x predicted) before we give up
    load_deadline_factor: float = 4.0
    load_chunk_bytes: int = 32 * 2**20  # one Get RPC; a deadline keeps the chunks that arrived
    down_backoff_s: float = 2.0  # after a daemon failure, skip lookups for this long
    offload_queue_bytes: int = 512 * 2**20  # staged KV waiting to be sent; beyond it, offloads are dropped
    offload_batch_bytes: int = 32 * 2**20  # one Put call
    offload_deadline_s: float = 10.0
    known_keys: int = 200_000  # LRU of keys known to be in the daemon (not sent again)
    ewma_alpha: float = 0.3  # weight of a new load measurement in a tier's bandwidth
    calibrate: bool = True  # time a few prefills at start-up (else use prefill_coeffs)
    # the most the start-up calibration waits, all told, for other processes to leave its cores
    # (engines started together time their prefills against each other: connector/calibrate.py); 0: never
    calibrate_quiet_wait_s: float = QUIET_WAIT_S
    prefill_coeffs: tuple[float, float, float] = (0.0, 0.0, 0.0)  # a, b, c when not calibrating
    prefill_learn: bool = True  # correct the prefill model online from the engine's timed steps
    probe: bool = True  # measure the daemon's latency/bandwidth at start-up
    use_shm: bool | None = None  # None = shared memory if the daemon allows it
    probe_tenant: str = ""  # the start-up probe's scratch blocks go in this tenant's namespace (kvengine: its
    # --tenant or an API key's tenant); "" = untagged keys, which a tenant's daemon credential may not write

    def __post_init__(self) -> None:
        host, _, port = self.address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"kvstore address must be HOST:PORT, got {self.address!r}")
        if self.load_mode not in LOAD_MODES:
            raise ValueError(f"load_mode must be one of {LOAD_MODES}, got {self.load_mode!r}")
        for name in ("lookup_deadline_s", "load_deadline_min_s", "load_deadline_factor", "offload_deadline_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.calibrate_quiet_wait_s < 0:
            raise ValueError("calibrate_quiet_wait_s must be >= 0")
        if not 0 < self.ewma_alpha <= 1:
            raise ValueError("ewma_alpha must be in (0, 1]")
        if min(self.load_chunk_bytes, self.offload_queue_bytes, self.offload_batch_bytes, self.known_keys) <= 0:
            raise ValueError("sizes must be > 0")
        if not self.calibrate and not any(self.prefill_coeffs):
            raise ValueError("calibrate=False needs prefill_coeffs")
        if self.probe_tenant:
            check_tenant_name(self.probe_tenant, "probe_tenant")

    @staticmethod
    def from_env(address: str, **overrides: object) -> ConnectorConfig:
        """Defaults < TIERKV_CONNECTOR_* environment < explicit overrides."""
        kw = ENV.overrides()
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return ConnectorConfig(address=address, **kw)  # type: ignore[arg-type]


ENV = EnvDeclaration("TIERKV_CONNECTOR_", ConnectorConfig, skip=("address", "prefill_coeffs", "use_shm"),
                     extra=(CALIBRATION_ENV,))
