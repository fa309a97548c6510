"""The plug-in contract of the engine: admission hooks propose, the scheduler applies.

An admission hook is asked, in order, what it can add to a request being admitted after the local
radix match (``propose``). It may take fresh pages from the narrow ``PageSource`` the scheduler
hands it and write KV into them (that is its job), and it returns a ``PrefixExtension``: those
pages, how many tokens of KV they now hold (starting at ``req.num_computed``), and whether that KV
is exact (equal to a prefill: it may be shared through the radix tree and offloaded) or
approximate (CacheBlend: never cached). The scheduler alone then applies it
(``Scheduler.apply_extension``): page references, radix insert and re-lock, the exact/approximate
boundary. A hook never touches the allocator's refcounts, the radix tree or the request's fields
owned by the scheduler; it reads the request and keeps its own state in its declared slot
(``Request.kv`` / ``Request.blend``).

The order of hooks is set by the composition root (connector/wiring.py), not here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:  # engine-internal types only
    from engine.request import HookState, Request


class PrefixExtension(NamedTuple):
    """What a hook adds after ``req.num_computed``: KV of ``tokens`` tokens in ``pages``.

    ``pages`` were taken from the PageSource (one reference each, handed over to the scheduler); the
    ones past ``ceil(tokens / page_size)`` are given back. An exact extension must be page-aligned;
    an approximate one keeps only its first ``exact_head`` tokens exact (e.g. a system prompt
    computed as a true prefix)."""

    pages: list[int]
    tokens: int
    exact: bool
    exact_head: int = 0


class PageSource(Protocol):
    """The only pool access a hook gets: fresh pages (evicting radix leaves if needed)."""

    page_size: int

    def alloc(self, n: int) -> list[int] | None: ...

    def free(self, pages: Sequence[int]) -> None: ...


class AdmissionHook(Protocol):
    def propose(self, req: Request, pages: PageSource) -> PrefixExtension | None:
        """After the local match and every earlier hook: what this hook can add (None: nothing)."""

    def on_finish(self, req: Request) -> None:
        """Before a finished request's pages are released (``req.exact_tokens`` of them are exact)."""

    def close(self) -> None:
        """Release what the hook holds (clients, threads); called once at engine shutdown."""


class KVConnectorPlugin(AdmissionHook, Protocol):
    """A KV connector is an admission hook whose staged offloads can be flushed at shutdown."""

    def flush(self, timeout_s: float) -> bool:
        """Send every staged offload; False if ``timeout_s`` passed first."""



class BlendRequests(Protocol):
    """What the HTTP server asks of CacheBlend: the prompt ids and the request's blend state."""

    def chat(self, messages: list[dict], documents: list[str], ratio: float | None) -> tuple[list[int], HookState]:
        ...

    def plain(self, prompt: str, separator: str, ratio: float | None) -> tuple[list[int], HookState]: ...
