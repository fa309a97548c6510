"""What a CacheBlend request carries under CacheBlend's key (``SLOT``) in ``Request.extras``: the
spec, then what was done (or, for the quality gate's full-prefill shadows, a ``ProbeState``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

from connector.blend.spec import BlendSpec
from engine.request import HookState, PromptUsage, Request

if TYPE_CHECKING:
    from connector.blend.quality_gate import Probe

SLOT = "cacheblend"  # CacheBlend's key in Request.extras


class BlendStats(NamedTuple):
    ratio: float  # recompute ratio used
    recomputed: int  # positions recomputed at layers >= 2
    selected: int  # document tokens picked at the check layer
    document_tokens: int
    exact_prefix: int  # tokens loaded exact (radix / daemon) before blending
    # the blended tokens (after exact_prefix) by where their KV came from, for usage:
    reused_head: int = 0  # exact head (BOS + system prompt) from a stored prefix chunk, not recomputed
    reused_documents: int = 0  # document tokens from stored chunks, not recomputed (approximate)
    recomputed_documents: int = 0  # document tokens recomputed (selected, or everything at r = 1)
    fresh: int = 0  # tokens of chunks computed for this request (the chunk store missed), not recomputed


@dataclass
class BlendState(HookState):
    spec: BlendSpec
    stats: BlendStats | None = None  # set once the prompt was blended (None: prefilled in full)
    gated: bool = False  # prefilled in full because the quality gate had switched blending off
    probe: Probe | None = None  # set on the quality gate's blended shadow of another request
    chunk_salt: str | None = None  # tenant of the chunks (None: the request's cache_salt)

    def account(self, usage: PromptUsage) -> PromptUsage:
        s = self.stats
        if s is None or usage.approximate == 0:
            return usage
        return replace(usage, reused_exact=s.reused_head, reused_approx=s.reused_documents,
                       selected=s.recomputed_documents, fresh=s.fresh)


def blend_extras(state: HookState) -> dict[str, HookState]:
    """A request's ``extras`` that make it CacheBlend's (a BlendState, or a quality-gate ProbeState)."""
    return {SLOT: state}


def blend_state(req: Request) -> HookState | None:
    """CacheBlend's state of ``req`` (None: not a blend request)."""
    return req.extras.get(SLOT)
