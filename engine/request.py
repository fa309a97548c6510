"""A request's state as it moves through the scheduler.

The KV of ``all_ids[:num_computed]`` is in the pool, in ``pages``; the tokens still to feed
are ``all_ids[num_computed:]``. A fresh prompt feeds many (prefill, possibly in chunks), a
decoding request feeds exactly one (its last sampled token), a preempted one feeds all again.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch

from engine.hooks import LoadingHook
from engine.radix_cache import TreeNode
from engine.sampling import SamplingParams
from engine.tenancy import split_salt

if TYPE_CHECKING:
    from engine.stop import StopState


class PageOutcome(NamedTuple):
    """How many of a prompt's pages had one cache outcome at one tier, as the plug-in that judged them
    says (the engine only carries them into the usage)."""

    reason: str  # the outcome, named by the plug-in
    tier: str | None  # where the plug-in found the pages (None: nowhere, or no tiers)
    pages: int


@dataclass(frozen=True)
class PromptUsage:
    """Where each prompt token's KV came from at the request's first admission (its usage).

    ``cached`` counts only tokens whose KV was NOT computed for this request: exact hits in the
    local radix tree, exact pages loaded by a KV connector (the kvstore daemon), and what an
    approximate extension (CacheBlend) reused without recomputing it — its exact head (BOS +
    system prompt) and the document tokens it did not select, both from chunks stored by earlier
    requests. Everything else was computed for this request (``computed``): the tokens the plug-in
    selected for recompute, chunks it had to compute first, and the plain prefill of the rest. The
    parts sum to ``prompt_tokens``. "Reused" is at every layer the plug-in does not recompute
    (CacheBlend recomputes its two check layers for all tokens; docs/architecture.md).
    """

    prompt_tokens: int
    radix: int = 0  # exact: the local radix tree
    loaded: int = 0  # exact: loaded by the KV connector
    loaded_tier: str | None = None  # the tier that held most of the loaded pages, if known
    approximate: int = 0  # tokens an approximate extension supplied; of those:
    reused_exact: int = 0  #   exact KV reused from the plug-in's store (a stored prefix chunk)
    reused_approx: int = 0  #   approximate KV reused without recompute (blended document tokens)
    selected: int = 0  #   recomputed because the plug-in's selection picked them
    fresh: int = 0  #   computed for this request by the plug-in (its chunk store missed)
    page_size: int = 0  # of ``pages``
    pages: tuple[PageOutcome, ...] = ()  # why each prompt page hit or missed the exact caches (a plug-in's)

    def __post_init__(self) -> None:
        parts = (self.radix, self.loaded, self.reused_exact, self.reused_approx, self.selected, self.fresh)
        if min(parts) < 0 or self.reused_exact + self.reused_approx + self.selected + self.fresh > self.approximate \
                or self.radix + self.loaded + self.approximate > self.prompt_tokens:
            raise ValueError(f"inconsistent prompt usage {self}")
        if self.pages and (self.page_size <= 0 or min(p.pages for p in self.pages) <= 0
                           or sum(p.pages for p in self.pages) != -(-self.prompt_tokens // self.page_size)):
            raise ValueError(f"page outcomes do not add up to the prompt's pages: {self}")

    @property
    def cached(self) -> int:
        """OpenAI's ``prompt_tokens_details.cached_tokens``: KV not computed for this request."""
        return self.radix + self.loaded + self.reused_exact + self.reused_approx

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.cached

    def cached_by_source(self) -> dict[str, int]:
        """Named as in the response's ``prompt_tokens_details.tierkv.cached`` and on /metrics."""
        return {"radix": self.radix, "daemon": self.loaded, "blend_prefix": self.reused_exact,
                "blend_reused": self.reused_approx}

    def computed_by_source(self) -> dict[str, int]:
        """Why computed: picked by blend selection, a chunk computed for this request, plain prefill."""
        return {"blend_selected": self.selected, "blend_chunk_miss": self.fresh,
                "prefill": self.computed - self.selected - self.fresh}


class HookState:
    """Base of a plug-in's per-request state, kept in ``Request.extras`` under the plug-in's own key."""

    def account(self, usage: PromptUsage) -> PromptUsage:
        """Refine the scheduler's usage with what only this plug-in knows (a tier, what it reused);
        called once, at first admission, after every hook proposed."""
        return usage


class Status(enum.Enum):
    WAITING = "waiting"  # queued (it may already hold its matched prefix and loaded KV: ``admission``)
    LOADING = "loading"  # queued, with a loading hook's fetch in flight (engine/hooks.py LoadingHook)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Admission:
    """The scheduler's record of a queued request's prefix: what the radix match and the hooks
    supplied so far (tokens), and how many hooks have had their turn. While it is set the request
    holds the pages and the radix lock of ``Request.num_computed`` tokens."""

    radix: int  # tokens of the local radix match
    exact: int = 0  # tokens of exact extensions applied (loaded KV)
    approx: int = 0  # tokens of approximate extensions applied (CacheBlend)
    next_hook: int = 0  # hooks[:next_hook] have proposed (or started and finished)
    loading: LoadingHook | None = None  # the hook whose fetch is in flight (while LOADING)


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
    usage: PromptUsage | None = None  # where the prompt's KV came from (set at first admission)
    first_token_time: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    #: the output text emitted so far (after stop-string truncation), one piece per step that emitted
    #: any: appending is O(1) where growing one string would copy the whole output every token
    text_pieces: list[str] = field(default_factory=list)
    stop_state: StopState | None = None  # the stop checker's (engine/stop.py): detokeniser window, held tail
    cache_limit: int | None = None  # KV past this many tokens is approximate (set by CacheManager.apply_extension)
    admission: Admission | None = None  # set from the prefix match until the request runs (the scheduler's)
    #: per-request state of the plug-ins, each under the key its plug-in chose and owned by it (the
    #: engine never looks inside; it asks each to ``account`` for the usage, in insertion order)
    extras: dict[str, HookState] = field(default_factory=dict)

    @property
    def tenant(self) -> str:
        """The tenant of the request's scope (engine/tenancy.py; "" for an unscoped one)."""
        return split_salt(self.cache_salt)[0]

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose KV was not computed for this request (usage; 0 before admission)."""
        return self.usage.cached if self.usage is not None else 0

    @property
    def exact_tokens(self) -> int:
        """Leading computed tokens whose KV equals a prefill: the only ones that may be cached or offloaded."""
        return self.num_computed if self.cache_limit is None else min(self.num_computed, self.cache_limit)

    @property
    def text(self) -> str:
        """The detokenized output so far (after stop-string truncation)."""
        return "".join(self.text_pieces)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids_between(self, start: int, end: int) -> list[int]:
        """``all_ids[start:end]`` without building ``all_ids`` (a decode step feeds one token: its cost
        must not grow with the prompt and the output)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n:end - n]
        return self.prompt_ids[start:] + self.output_ids[:end - n]

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
    usage: PromptUsage | None = None  # the split behind cached_tokens
