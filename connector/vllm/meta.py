"""What crosses vLLM's process boundary: the scheduler's plan for one step, and the worker's report.

vLLM pickles the connector metadata from the EngineCore's scheduler to the worker(s), and the
worker metadata back; so these are plain dataclasses of ints, strings and bytes, no tensors, no
references to vLLM's objects. Keys are computed on the scheduler side (it has the token ids); the
worker only moves bytes between the daemon and the block ids it is told.
"""

from __future__ import annotations

from dataclasses import dataclass, field

try:  # the base classes exist only inside vLLM; the plan itself is plain data either way
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorWorkerMetadata,
    )
except ImportError:  # pragma: no cover - exercised by the unit tests without vLLM
    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass

    class KVConnectorWorkerMetadata:  # type: ignore[no-redef]
        pass


@dataclass
class LoadSpec:
    """Copy the daemon's blocks ``keys`` into vLLM blocks ``block_ids`` for one request."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    tiers: list[str]  # where the lookup found each block (the cost model learns per tier)
    deadline_s: float
    sync: bool = False  # in the step (vLLM scheduled the request over it), not reported by get_finished


@dataclass
class SaveSpec:
    """Gather vLLM blocks ``block_ids`` after this step's forward and write them as ``keys``."""

    keys: list[bytes]
    block_ids: list[int]


@dataclass
class TierKVMetadata(KVConnectorMetadata):
    step: int = 0
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    #: (tokens fed, tokens already computed) of every request this step runs: the worker times
    #: the step and reports both, and the scheduler fits the prefill model from them
    seqs: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class LoadOutcome:
    req_id: str
    loaded: int  # leading blocks copied and verified
    wanted: int
    tiers: list[str]  # tiers of the loaded blocks
    seconds: float
    nbytes: int
    reason: str = ""  # why it stopped short: missing | corrupt | deadline | error | cancelled
    bad_keys: list[bytes] = field(default_factory=list)  # corrupt: deleted from the daemon


@dataclass
class TierKVWorkerMetadata(KVConnectorWorkerMetadata):
    steps: list[tuple[list[tuple[int, int]], float]] = field(default_factory=list)
    loads: list[LoadOutcome] = field(default_factory=list)
    saved_keys: list[bytes] = field(default_factory=list)

    def aggregate(self, other: TierKVWorkerMetadata) -> TierKVWorkerMetadata:  # type: ignore[override]
        """Several workers (tensor parallel) each time the same step: keep the slowest; loads and
        saves are per worker, so they add up."""
        steps = self.steps if len(self.steps) >= len(other.steps) else other.steps
        if len(self.steps) == len(other.steps):
            steps = [(s, max(a, b)) for (s, a), (_, b) in zip(self.steps, other.steps, strict=True)]
        return TierKVWorkerMetadata(steps, self.loads + other.loads, self.saved_keys + other.saved_keys)
