"""The plug-in contract of the engine: admission hooks propose, the scheduler applies.

An admission hook is asked, in order, what it can add to a request being admitted after the local
radix match (``propose``). It may take fresh pages from the narrow ``PageSource`` the scheduler
hands it and write KV into them (that is its job), and it returns a ``PrefixExtension``: those
pages, how many tokens of KV they now hold (starting at ``req.num_computed``), and whether that KV
is exact (equal to a prefill: it may be shared through the radix tree and offloaded) or
approximate (CacheBlend: never cached). The scheduler's CacheManager alone then applies it
(engine/cache_manager.py ``apply_extension``): page references, radix insert and re-lock, the
exact/approximate boundary (nothing follows approximate KV). A hook never touches the allocator's
refcounts, the radix tree or the request's fields owned by the scheduler; it reads the request and
keeps its own state under its own key in ``Request.extras``.

A *loading* hook (``LoadingHook``: the KV connector) fetches off the engine thread instead: the
scheduler asks it to ``start`` as soon as a request is queued (prefetch), polls it once per step on
the engine thread (``poll``: pending, or done with the extension to apply) and tells it when the
request goes away (``cancel``). Pages for the fetch are still taken from the ``PageSource``, on the
engine thread, in ``start`` or ``poll``; they belong to the hook's worker until a poll reports done,
and then come back in the extension, to be applied or freed by the scheduler. Loading hooks run before
the plain ones (which propose at admission, once the loads are in).

Hooks are built with an ``EngineView`` (what they read of the engine, nothing else), and what a
hook wants to run itself goes through the view's ``submit``: it is admitted after the step, never
from inside a scheduler method. The order of hooks is set by the composition root
(connector/wiring.py), not here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:  # engine-internal types only
    import torch

    from engine.forward_batch import ForwardBatch
    from engine.kv_pool import KVPool
    from engine.model import LlamaModel
    from engine.model_loader import ModelArch
    from engine.request import HookState, Request
    from engine.sampling import SamplingParams
    from engine.shared_prefix import SharedPrefixes


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
    """The only pool access a hook gets (engine/cache_manager.py ``HookPages``, not the scheduler)."""

    def alloc(self, n: int) -> list[int] | None:
        """``n`` fresh pages, evicting radix leaves if needed (one reference each); None if too few."""

    def alloc_upto(self, n: int) -> list[int]:
        """At most ``n`` fresh pages: as many as the pool gives now (radix leaves evicted if needed),
        less the headroom its owner keeps for running requests."""

    def free(self, pages: Sequence[int]) -> None:
        """Give back pages taken with ``alloc`` and not handed over in an extension."""


class Submit(Protocol):
    """Queue a request from a plug-in (the quality gate's shadows): checked at once (EngineError:
    nothing queued), admitted after the step it was submitted in, never from inside a scheduler call."""

    def __call__(self, prompt_ids: Sequence[int], params: SamplingParams, *, rid: str | None = None,
                 cache_salt: str | None = None, extras: Mapping[str, HookState] | None = None) -> str: ...


@dataclass(frozen=True)
class EngineView:
    """What a plug-in is built with: exactly what connector/ reads of the engine, never the engine.

    A hook reads and writes only the pool pages it holds (taken from ``pages``, or handed to it in a
    request); ``pages`` also serves scratch pages outside a hook call (start-up measurements)."""

    arch: ModelArch  # the model's config
    fingerprint: str  # of the loaded weights: namespaces KV keys and chunks
    device: torch.device
    dtype: torch.dtype  # of the weights and the KV
    pool: KVPool  # the pool tensors (page size, bytes per page, read/write of pages)
    model: LlamaModel  # its layers (CacheBlend runs them itself)
    forward: Callable[[ForwardBatch], torch.Tensor]  # one forward pass over the pool (logits)
    shared: SharedPrefixes  # the prefixes every tenant shares (engine/shared_prefix.py; maybe none)
    pages: PageSource
    submit: Submit


class AdmissionHook(Protocol):
    def propose(self, req: Request, pages: PageSource) -> PrefixExtension | None:
        """After the local match and every earlier hook: what this hook can add (None: nothing)."""

    def on_finish(self, req: Request) -> None:
        """Before a finished request's pages are released (``req.exact_tokens`` of them are exact)."""

    def close(self) -> None:
        """Release what the hook holds (clients, threads); called once at engine shutdown."""


class LoadPoll(NamedTuple):
    """A loading hook's answer on the engine thread: still pending, or done (its worker has let go
    of every page it was given) with what it proposes (None: nothing, and no pages)."""

    done: bool
    extension: PrefixExtension | None = None


PENDING = LoadPoll(False)
NOTHING = LoadPoll(True)


@runtime_checkable
class LoadingHook(Protocol):
    """An admission hook whose KV arrives off the engine thread (the request waits in LOADING)."""

    def start(self, req: Request, pages: PageSource, prefill_ahead: Sequence[tuple[int, int]],
              wake: Callable[[], None]) -> bool:
        """Begin fetching KV past ``req.num_computed`` (engine thread, returns at once); True if a
        fetch is in flight. ``prefill_ahead``: (tokens to feed, tokens cached) of each prefill queued
        ahead of this request; ``wake`` is called from the worker when the next poll has news."""

    def poll(self, req: Request, pages: PageSource) -> LoadPoll:
        """Engine thread: PENDING, or done with the extension to apply. Pages taken from ``pages``
        here or in ``start`` are the worker's until the poll that reports done returns them (all of
        them) in the extension."""

    def cancel(self, req: Request) -> None:
        """The request is gone: stop early. Polls go on until one reports done (with the pages)."""

    def on_finish(self, req: Request) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class KVConnectorPlugin(LoadingHook, Protocol):
    """A KV connector is a loading hook whose staged offloads can be flushed at shutdown."""

    def flush(self, timeout_s: float) -> bool:
        """Send every staged offload; False if ``timeout_s`` passed first."""


class DocumentPrompts(Protocol):
    """What the HTTP server asks of the plug-in that serves requests with ``documents`` (chat) or a
    ``blend_separator`` (completions): the prompt ids, and the request's plug-in state
    (``Request.extras``)."""

    def chat(self, messages: list[dict], documents: list[str],
             ratio: float | None) -> tuple[list[int], Mapping[str, HookState]]: ...

    def plain(self, prompt: str, separator: str, ratio: float | None) -> tuple[list[int], Mapping[str, HookState]]: ...
