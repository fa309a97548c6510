"""The heart of the engine: one owner of page state (engine/cache_manager.py), admission of what the
hooks bring (engine/admission.py), and hooks that propose, never apply.

The CacheManager tests run on a bare pool and radix tree (no model pass); the admission tests on the
tiny Llama."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, fields

import pytest
import torch

from engine.cache_manager import CacheManager, HookPages
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError, PromptTooLongError
from engine.hooks import EngineView, PageSource, PrefixExtension
from engine.kv_pool import KVPool
from engine.radix_cache import RadixCache
from engine.request import Request
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from tests.fixtures_engine import make_engine

PS = 16


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 40000, (n,), generator=g).tolist()


@pytest.fixture
def cache(tiny) -> CacheManager:
    pool = KVPool(tiny.arch, 16, PS, torch.float32, torch.device("cpu"))
    return CacheManager(pool, RadixCache(PS, pool.allocator))


def _computed(cache: CacheManager, ids: list[int], tokens: int) -> Request:
    """A request that computed ``tokens`` of ``ids`` (its pages taken, as the scheduler's ``grow`` would)."""
    req = Request("r", ids, SamplingParams())
    cache.match(req, record_stats=False)
    assert cache.grow(req, tokens)
    req.num_computed = tokens
    return req


def _refs(cache: CacheManager, pages: list[int]) -> list[int]:
    return [cache.pool.allocator.refcount(p) for p in pages]


# -- CacheManager: match / incref / lock / release / reclaim --------------------------------------
def test_match_takes_a_ref_and_the_lock_release_gives_them_back(cache: CacheManager) -> None:
    ids = _prompt(50)
    first = _computed(cache, ids, 40)
    cache.release(first, cache=True)  # its two full pages go to the radix tree, the partial one back
    alloc = cache.pool.allocator
    assert first.pages == [] and first.radix_node is None and alloc.num_used() == 2

    req = Request("b", ids, SamplingParams())
    assert cache.match(req, record_stats=False) == 32
    assert req.num_computed == 32 and len(req.pages) == 2 and req.cache_limit is None
    assert _refs(cache, req.pages) == [2, 2]  # the tree's ref and the request's
    assert cache.radix.evict(2) == 0  # locked: nothing to evict
    pages = list(req.pages)
    cache.release(req, cache=False)
    assert _refs(cache, pages) == [1, 1] and req.radix_node is None
    assert cache.radix.evict(2) == 2 and alloc.num_free() == alloc.num_pages  # unlocked: evictable
    alloc.check_integrity()


def test_alloc_evicts_radix_leaves_and_pages_go_back(cache: CacheManager) -> None:
    ids = _prompt(16 * 15 + 1)
    cache.release(_computed(cache, ids, 16 * 15), cache=True)  # 15 of the 16 pages in the tree (one node)
    assert cache.radix.total_pages() == 15
    pages = cache.alloc(3)  # one page is free: the leaf is evicted (whole nodes only)
    assert pages is not None and len(pages) == 3 and cache.radix.total_pages() == 0
    cache.free(pages)
    assert cache.pool.allocator.num_free() == cache.pool.num_pages
    cache.radix.check_integrity()
    cache.pool.allocator.check_integrity()


def test_rematch_takes_the_longer_prefix_computed_meanwhile(cache: CacheManager) -> None:
    ids = _prompt(70)
    cache.release(_computed(cache, ids, 16), cache=True)
    queued = Request("q", ids, SamplingParams())
    assert cache.match(queued, record_stats=False) == 16
    cache.release(_computed(cache, ids, 64), cache=True)  # a request ahead computed more of it
    assert cache.rematch(queued) == 48 and queued.num_computed == 64 and len(queued.pages) == 4
    assert _refs(cache, queued.pages) == [2, 2, 2, 2]
    cache.release(queued, cache=False)
    cache.radix.reset()
    assert cache.pool.allocator.num_free() == cache.pool.num_pages


def test_reclaim_gives_back_the_first_held_prefix(cache: CacheManager) -> None:
    ids = _prompt(40)
    cache.release(_computed(cache, ids, 32), cache=True)
    holder, empty = Request("h", ids, SamplingParams()), Request("e", _prompt(40, seed=1), SamplingParams())
    cache.match(holder, record_stats=False)
    assert not cache.reclaim([empty])  # holds no prefix
    assert cache.reclaim([empty, holder])
    assert holder.radix_node is None and holder.pages == [] and holder.num_computed == 0
    assert cache.radix.evict(2) == 2  # the prefix stayed in the tree, evictable


# -- CacheManager: apply_extension ----------------------------------------------------------------
def test_exact_extension_enters_the_tree_and_relocks(cache: CacheManager) -> None:
    ids = _prompt(60)
    req = Request("r", ids, SamplingParams())
    cache.match(req, record_stats=False)
    fresh = cache.alloc(4)
    assert fresh is not None
    assert cache.apply_extension(req, PrefixExtension(fresh, 2 * PS, exact=True))
    assert req.pages == fresh[:2] and req.num_computed == 32 and req.cache_limit is None
    assert cache.radix.match_prefix(ids, record_stats=False).num_tokens == 32  # shared at once
    assert cache.pool.allocator.num_used() == 2  # the two surplus pages went back
    assert cache.radix.evict(2) == 0  # the request locks the deeper node
    cache.release(req, cache=True)
    cache.pool.allocator.check_integrity()


def test_no_extension_after_approximate_kv_even_page_aligned(cache: CacheManager) -> None:
    """An approximate extension that ends page-aligned sets ``cache_limit``; an exact one after it must
    be refused, or the radix insert of the exact extension would share the approximate KV before it."""
    ids = _prompt(100)
    req = Request("r", ids, SamplingParams())
    cache.match(req, record_stats=False)
    approx = cache.alloc(3)
    assert approx is not None
    assert cache.apply_extension(req, PrefixExtension(approx, 3 * PS, exact=False, exact_head=PS))
    assert req.num_computed == 48 and req.cache_limit == PS and req.exact_tokens == PS
    exact = cache.alloc(2)
    assert exact is not None
    assert not cache.apply_extension(req, PrefixExtension(exact, 2 * PS, exact=True))
    assert req.num_computed == 48 and req.pages == approx  # refused: nothing changed
    assert cache.radix.match_prefix(ids, record_stats=False).num_tokens == 0  # no approximate KV shared
    assert [cache.pool.allocator.refcount(p) for p in exact] == [0, 0]  # its pages went back
    cache.release(req, cache=True)  # only the exact head is cached
    assert cache.radix.match_prefix(ids, record_stats=False).num_tokens == PS
    cache.pool.allocator.check_integrity()


def test_no_extension_after_a_partial_page(cache: CacheManager) -> None:
    req = Request("r", _prompt(60), SamplingParams())
    cache.match(req, record_stats=False)
    part = cache.alloc(1)
    assert part is not None and cache.apply_extension(req, PrefixExtension(part, 10, exact=False))
    more = cache.alloc(1)
    assert more is not None and not cache.apply_extension(req, PrefixExtension(more, PS, exact=True))
    assert req.num_computed == 10 and cache.pool.allocator.refcount(more[0]) == 0


def test_a_malformed_extension_raises_and_frees_its_pages(cache: CacheManager) -> None:
    req = Request("r", _prompt(60), SamplingParams())
    for ext_of in (lambda p: PrefixExtension(p, 20, exact=True), lambda p: PrefixExtension(p, 3 * PS, exact=True),
                   lambda p: PrefixExtension(p, -1, exact=False)):
        pages = cache.alloc(2)
        with pytest.raises(ValueError, match="bad extension"):
            cache.apply_extension(req, ext_of(pages))
        assert cache.pool.allocator.num_free() == cache.pool.num_pages and req.pages == []


def test_hooks_get_a_three_method_page_source_not_the_cache(cache: CacheManager) -> None:
    pages = cache.pages
    assert isinstance(pages, HookPages) and not hasattr(pages, "__dict__")
    assert {n for n in dir(pages) if not n.startswith("_")} == {"alloc", "alloc_upto", "free"}
    assert {n for n in PageSource.__dict__ if not n.startswith("_")} == {"alloc", "alloc_upto", "free"}
    got = pages.alloc(2)
    assert got is not None and cache.pool.allocator.num_used() == 2
    pages.free(got)
    assert cache.pool.allocator.num_used() == 0
    n = cache.pool.num_pages
    held = pages.alloc(n - 3)
    assert held is not None and pages.alloc(5) is None
    some = pages.alloc_upto(5)  # what the pool gives: 3
    assert len(some) == 3 and pages.alloc_upto(5) == []
    pages.free(some)
    cache.headroom = lambda: 2  # the scheduler's: a page per running request stays free
    some = pages.alloc_upto(5)
    assert len(some) == 1 and pages.alloc_upto(5) == []
    pages.free(held + some)
    assert cache.pool.allocator.num_used() == 0


# -- admission on a real engine: hooks propose once, through the page source; submissions wait ----
class _Recorder:
    """A plain hook built with the engine's view: records what it is handed; ``on_finish`` of the
    request named ``follow_up_of`` submits a follow-up request, and notes what the engine held then."""

    def __init__(self, view: EngineView, follow_up_of: str | None = None) -> None:
        self.view, self.follow_up_of = view, follow_up_of
        self.pages: list[object] = []
        self.proposed: list[str] = []
        self.seen_inside_finish: list[bool] = []
        self.engine: LLMEngine | None = None  # the test's, to look at (the hook never uses it)

    def propose(self, req: Request, pages: PageSource) -> PrefixExtension | None:
        self.pages.append(pages)
        self.proposed.append(req.rid)
        return None

    def on_finish(self, req: Request) -> None:
        if req.rid == self.follow_up_of:
            self.view.submit(req.prompt_ids, SamplingParams(max_tokens=2, ignore_eos=True), rid="follow-up")
            assert self.engine is not None
            sched = self.engine.scheduler
            self.seen_inside_finish.append("follow-up" in self.engine.requests
                                           or any(r.rid == "follow-up" for r in sched.waiting))

    def close(self) -> None:
        pass


def test_a_hook_proposes_once_per_admission_through_the_page_source(tiny) -> None:
    eng = make_engine(tiny, num_threads=0)
    hook = _Recorder(eng.view)
    eng.hooks = [hook]
    eng.generate([_prompt(40), _prompt(40, seed=1)], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(hook.proposed) == 2 and len(set(hook.proposed)) == 2  # once per request
    assert all(p is eng.scheduler.cache.pages for p in hook.pages)  # the HookPages, not the scheduler
    assert not isinstance(hook.pages[0], (Scheduler, CacheManager))


def test_the_view_is_what_plugins_read_not_the_engine(tiny) -> None:
    eng = make_engine(tiny, num_threads=0)
    view = eng.view
    assert not any(isinstance(getattr(view, f.name), (LLMEngine, Scheduler, CacheManager)) for f in fields(view))
    assert view.pool is eng.pool and view.arch is eng.arch and view.pages is eng.scheduler.cache.pages
    with pytest.raises(FrozenInstanceError):
        view.pool = None  # type: ignore[misc]


def test_a_submission_from_inside_finish_is_admitted_after_the_step(tiny) -> None:
    eng = make_engine(tiny, num_threads=0)
    hook = _Recorder(eng.view, follow_up_of="first")
    hook.engine = eng
    eng.hooks = [hook]
    first = eng.requests[eng.add_request(_prompt(30), SamplingParams(max_tokens=2, ignore_eos=True), rid="first")]
    while not first.finished:
        eng.step()
    assert hook.seen_inside_finish == [False]  # not queued while Scheduler.finish ran
    assert "follow-up" in eng.requests and eng.has_unfinished()  # queued once the step returned
    follow = eng.requests["follow-up"]
    while not follow.finished:
        eng.step()
    assert follow.output_ids and not eng.has_unfinished()
    assert hook.proposed == ["first", "follow-up"]


def test_a_submission_is_checked_at_once_and_can_be_aborted(tiny) -> None:
    eng = make_engine(tiny, num_threads=0)
    with pytest.raises(PromptTooLongError):
        eng.view.submit(_prompt(64 * 16), SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError):
        eng.view.submit([], SamplingParams())
    rid = eng.view.submit(_prompt(20), SamplingParams(max_tokens=2), rid="s")
    with pytest.raises(InvalidRequestError, match="duplicate"):
        eng.add_request(_prompt(20), SamplingParams(), rid=rid)
    assert eng.has_unfinished() and rid not in eng.requests and not eng.scheduler.waiting
    eng.abort(rid)
    assert not eng.has_unfinished()
    assert eng.step() == [] and rid not in eng.requests
