"""The admission-hook contract: a hook proposes, CacheManager.apply_extension alone applies.

The hook here is real: it copies a prefix's KV out of another engine's pool (same model), so
outputs can be compared with a plain run."""

from __future__ import annotations

import pytest
import torch

from engine.engine import LLMEngine
from engine.hooks import PageSource, PrefixExtension
from engine.request import Request
from engine.sampling import SamplingParams
from tests.fixtures_engine import make_engine

PS = 16


def _prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 40000, (n,), generator=g).tolist()


#: the engine of these tests: make_engine(tiny, **ENGINE)
ENGINE = dict(num_pages=32, page_size=PS, max_prefill_tokens=256, num_threads=0)


class PeerPool:
    """Offers the prefix another engine has in its radix tree (its pages copied into fresh ones)."""

    def __init__(self, peer: LLMEngine, exact: bool = True, exact_head: int = 0, surplus: int = 0) -> None:
        self.peer, self.exact, self.exact_head, self.surplus = peer, exact, exact_head, surplus
        self.target: LLMEngine | None = None

    def propose(self, req: Request, pages: PageSource) -> PrefixExtension | None:
        start = req.num_computed // PS
        m = self.peer.radix.match_prefix(req.all_ids[:-1], record_stats=False)
        if len(m.pages) <= start:
            return None
        src = m.pages[start:]
        fresh = pages.alloc(len(src) + self.surplus)
        assert fresh is not None
        assert self.target is not None
        self.target.pool.write_pages(fresh[: len(src)], self.peer.pool.read_pages(src))  # same model: KV
        return PrefixExtension(fresh, len(src) * PS, self.exact, self.exact_head)

    def on_finish(self, req: Request) -> None:
        pass

    def close(self) -> None:
        pass


def _with_hooks(eng: LLMEngine, *hooks: PeerPool) -> None:
    for h in hooks:
        h.target = eng
    eng.hooks = list(hooks)


def _run(eng: LLMEngine, ids: list[int]) -> Request:
    return eng.generate([ids], SamplingParams(max_tokens=5, ignore_eos=True))[0]


def test_exact_extension_is_shared_at_once_and_surplus_pages_go_back(tiny) -> None:
    ids = _prompt(100)
    peer = make_engine(tiny, **ENGINE)
    want = _run(peer, ids)
    eng = make_engine(tiny, **ENGINE)
    _with_hooks(eng, PeerPool(peer, surplus=2))
    rid = eng.add_request(ids, SamplingParams(max_tokens=5, ignore_eos=True))
    req = eng.requests[rid]
    eng.step()  # admission + first prefill chunk
    assert req.cached_tokens == 96
    assert eng.radix.match_prefix(ids, record_stats=False).num_tokens == 96  # in the tree before finishing
    while not req.finished:
        eng.step()
    assert req.output_ids == want.output_ids
    eng.radix.check_integrity()
    eng.pool.allocator.check_integrity()
    eng.radix.reset()
    assert eng.pool.allocator.num_free() == eng.pool.num_pages  # the 2 surplus pages were given back


def test_approximate_extension_never_enters_the_radix_tree(tiny) -> None:
    ids = _prompt(100, seed=1)
    peer = make_engine(tiny, **ENGINE)
    want = _run(peer, ids)
    eng = make_engine(tiny, **ENGINE)
    _with_hooks(eng, PeerPool(peer, exact=False, exact_head=32))
    got = _run(eng, ids)
    assert got.output_ids == want.output_ids and got.cache_limit == 32 and got.exact_tokens == 32
    assert eng.radix.match_prefix(ids, record_stats=False).num_tokens == 32  # only the exact head
    eng.radix.check_integrity()
    eng.pool.allocator.check_integrity()


def test_nothing_follows_an_approximate_extension(tiny) -> None:
    ids = _prompt(100, seed=2)
    peer = make_engine(tiny, **ENGINE)
    want = _run(peer, ids)
    eng = make_engine(tiny, **ENGINE)

    class Partial(PeerPool):  # approximate, and not page-aligned
        def propose(self, req, pages):
            ext = super().propose(req, pages)
            return ext._replace(tokens=ext.tokens - 3)

    _with_hooks(eng, Partial(peer, exact=False), PeerPool(peer))
    got = _run(eng, ids)
    assert got.cached_tokens == 93 and got.output_ids == want.output_ids
    eng.radix.reset()
    assert eng.pool.allocator.num_free() == eng.pool.num_pages  # the dropped extension's pages went back
    eng.pool.allocator.check_integrity()


def test_a_malformed_extension_is_refused_and_its_pages_freed(tiny) -> None:
    eng = make_engine(tiny, **ENGINE)
    req = Request("r", _prompt(60, seed=3), SamplingParams())
    for ext_of in (lambda p: PrefixExtension(p, 20, exact=True),  # exact but not page-aligned
                   lambda p: PrefixExtension(p, 3 * PS, exact=True)):  # more tokens than pages
        pages = eng.scheduler.cache.alloc(2)
        with pytest.raises(ValueError, match="bad extension"):
            eng.scheduler.cache.apply_extension(req, ext_of(pages))
        assert eng.pool.allocator.num_free() == eng.pool.num_pages and req.pages == []
