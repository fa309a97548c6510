"""A request's state as it moves through the scheduler.

The KV of ``all_ids[:num_computed]`` is in the pool, in ``pages``; the tokens still to feed
are ``all_ids[num_computed:]``. A fresh prompt feeds many (prefill, possibly in chunks), a
decoding request feeds exactly one (its last sampled token), a preempted one feeds all again.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from engine.radix_cache import TreeNode
from engine.sampling import SamplingParams


class HookState:
    """Base of a plug-in's per-request state (a declared slot on Request, not a dict of keys)."""


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    pages: list[int] = field(default_factory=list)  # refs held by this request
    num_computed: int = 0
    radix_node: TreeNode | None = None  # locked radix node of the matched prefix
    cached_tokens: int = 0  # prompt tokens served from a cache at first admission (usage)
    cached_reported: bool = False
    first_token_time: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    text: str = ""  # detokenized output so far (after stop-string truncation)
    cache_limit: int | None = None  # KV past this many tokens is approximate (set by Scheduler.apply_extension)
    # per-request state of the plug-ins, each owned by its hook (the engine never looks inside)
    kv: HookState | None = None  # the KV connector's (connector/state.py KVState)
    blend: HookState | None = None  # a CacheBlend request's (connector/blend/state.py BlendState)

    @property
    def exact_tokens(self) -> int:
        """Leading computed tokens whose KV equals a prefill: the only ones that may be cached or offloaded."""
        return self.num_computed if self.cache_limit is None else min(self.num_computed, self.cache_limit)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def remaining(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class RequestOutput:
    rid: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: str | None = None
