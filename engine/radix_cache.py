"""Radix-tree prefix cache over token ids, page-aligned, on top of the paged KV pool.

SGLang-style: every node holds a run of whole pages (its ``tokens`` and the ``pages`` that store
their KV); children are keyed by the tuple of their first page's tokens, so two children may share
a first token yet differ later in that page, and a match stops at the last whole page that agrees.

Ownership: the tree holds one allocator ref on each page it owns (taken by ``insert``, dropped by
``evict``/``reset``); a request holds its own ref on each page of its context. ``match_prefix``
takes no ref: the caller increfs the pages it keeps and ``lock``s the returned node so that
eviction cannot take the path away while it runs.

Tenants: every ``cache_salt`` has its own root, so requests of different tenants never share a
node (nor its pages); evicted nodes carry their salt so an offloader keys them in that tenant's
namespace. The one exception is what the operator declared shared (engine/shared_prefix.py): the
leading pages of a prompt that lie inside a declared prefix live under a shared root, whatever the
salt, and a tenant's pages after them hang below the last shared node, keyed by (salt, first page)
so tenants still never share a node past the declared tokens. Each node records its ``scope``
(its tenant's salt, or None for a shared node); ``match_prefix`` and ``insert`` take the request's
salt and route each page themselves, so callers need not know what is shared.
A tenant's root exists only while its tree holds a node: ``insert`` makes it, the eviction of its
last node drops it, and a match in a salt with no tree walks a throwaway empty root. So the per-salt
state is bounded by the cached pages, however many salts clients send, and eviction walks only the
trees that hold pages. A dropped salt's next request starts an empty tree: it can share nothing.

Locks count along the path: ``lock(node)`` adds one to the node and every ancestor (the root is
never counted), so a node's ``lock_ref`` is its own locks plus the sum of its children's. A node
with ``lock_ref == 0`` is evictable once it is a leaf; ``evictable_pages`` counts pages in all
unlocked nodes (all of them can go, leaves first).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from typing import NamedTuple

from engine.page_allocator import PageAllocator
from engine.shared_prefix import SharedPrefixes

Tokens = tuple[int, ...]
Scope = str | None  # a tenant's salt ("" = no salt), or None: the operator-declared shared namespace
ChildKey = Tokens | tuple[str, Tokens]


class TreeNode:
    """One edge of the radix tree. Read-only for callers; only RadixCache mutates it."""

    __slots__ = ("node_id", "tokens", "pages", "parent", "children", "lock_ref", "last_access", "scope")

    def __init__(self, node_id: int, tokens: Tokens, pages: list[int], parent: TreeNode | None,
                 last_access: int, lock_ref: int = 0, scope: Scope = "") -> None:
        self.node_id = node_id
        self.tokens = tokens
        self.pages = pages
        self.parent = parent  # None for the root and for nodes removed from the tree
        self.children: dict[ChildKey, TreeNode] = {}  # see _key
        self.lock_ref = lock_ref
        self.last_access = last_access
        self.scope = scope  # the tenant salt of its pages; None: declared shared (module notes)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.node_id}, tokens={len(self.tokens)}, pages={self.pages}, lock={self.lock_ref})"


class MatchResult(NamedTuple):
    pages: list[int]  # pages of the matched prefix, in order
    node: TreeNode  # deepest matched node, ending exactly at the match (the root if none)
    num_tokens: int  # == len(pages) * page_size


class EvictedNode(NamedTuple):
    prefix_tokens: Tokens  # tokens from the root up to the start of this node
    tokens: Tokens  # this node's tokens
    pages: list[int]  # this node's pages (still allocated while the hook runs)
    salt: str = ""  # tenant (request cache_salt) whose node it was; "" for a shared node (keyed shared)


EvictHook = Callable[[list[EvictedNode]], None]


def _key(parent: TreeNode, scope: Scope, first_page: Tokens) -> ChildKey:
    """A child's key in ``parent.children``: its first page, and below a shared node also the
    tenant's salt for a tenant's child (tenants continuing one shared prompt never share a node)."""
    return (scope, first_page) if parent.scope is None and scope is not None else first_page


def _as_tuple(tokens: Sequence[int]) -> Tokens:
    if isinstance(tokens, tuple):
        return tokens
    tolist = getattr(tokens, "tolist", None)  # numpy arrays / torch tensors -> python ints
    return tuple(tolist() if callable(tolist) else tokens)


class RadixCache:
    def __init__(self, page_size: int, allocator: PageAllocator, on_evict: EvictHook | None = None,
                 shared: SharedPrefixes | None = None) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        if shared is not None and shared.page_size != page_size:
            raise ValueError(f"shared prefixes of {shared.page_size}-token pages for a tree of {page_size}")
        self.page_size = page_size
        self.allocator = allocator
        self.on_evict = on_evict
        self.shared = shared or SharedPrefixes((), page_size)  # the operator's declared shared prefixes
        self._ids = itertools.count()
        self._clock = 0  # LRU clock: bumped once per match/insert, never wall time
        self._root = TreeNode(next(self._ids), (), [], None, 0)
        # one tree per tenant salt; None: the shared tree (no salt spells None)
        self._roots: dict[Scope, TreeNode] = {"": self._root}
        self._owned: set[int] = set()
        self._evictable = 0  # pages in nodes with lock_ref == 0
        self.tokens_requested = 0
        self.tokens_hit = 0

    # ------------------------------------------------------------------ lookup / insert

    @property
    def root(self) -> TreeNode:
        return self._root

    def _root_for(self, scope: Scope, create: bool) -> TreeNode:
        """The tree of one tenant (requests with different salts never share a node), or with
        None the shared tree. Without ``create`` a salt with no tree gets an empty root that is not
        kept (a miss must not leave state behind)."""
        root = self._roots.get(scope)
        if root is None:
            root = TreeNode(next(self._ids), (), [], None, 0, scope=scope)
            if create:
                self._roots[scope] = root
        return root

    def _shared_end(self, toks: Tokens) -> int:
        """Tokens of the leading pages of ``toks`` inside a declared shared prefix."""
        return self.shared.shared_pages(toks) * self.page_size if self.shared else 0

    def _is_root(self, node: TreeNode) -> bool:
        return node.parent is None and not node.tokens

    def match_prefix(self, tokens: Sequence[int], record_stats: bool = True, salt: str | None = None) -> MatchResult:
        """Longest whole-page prefix of ``tokens`` in the tenant ``salt``'s tree. Splits a node if
        the match ends inside it. Refreshes the LRU clock along the path; takes no page refs."""
        toks = _as_tuple(tokens)
        pages: list[int] = []
        node, num = self._walk(toks, pages, salt or "", self._shared_end(toks), create=False)
        if record_stats:
            self.tokens_requested += len(toks)
            self.tokens_hit += num
        return MatchResult(pages, node, num)

    def insert(self, tokens: Sequence[int], pages: Sequence[int], salt: str | None = None) -> int:
        """Add ``tokens`` (stored in ``pages``, one per page_size tokens) to the tree.

        Returns how many leading tokens were already present; their entries in ``pages`` are not
        adopted. The tree increfs each page it adopts. Raises ValueError on a length mismatch or
        on a page that the tree already owns or that is free (before adopting anything)."""
        toks = _as_tuple(tokens)
        pages = list(pages)
        ps = self.page_size
        if len(toks) != len(pages) * ps:
            raise ValueError(f"{len(toks)} tokens for {len(pages)} pages of {ps}")
        salt = salt or ""
        shared_end = self._shared_end(toks)
        node, num = self._walk(toks, None, salt, shared_end, create=True)
        if num == len(toks):
            return num
        new_pages = pages[num // ps:]
        if len(set(new_pages)) != len(new_pages):
            raise ValueError(f"duplicate pages in insert: {new_pages}")
        for p in new_pages:
            if p in self._owned:
                raise ValueError(f"page {p} is already owned by the radix cache")
            if self.allocator.refcount(p) <= 0:
                raise ValueError(f"page {p} is free; the caller must hold a ref on it")
        self.allocator.incref(new_pages)
        # the new pages inside the declared prefix go below a shared node, the rest the tenant's
        for lo, hi, scope in ((num, shared_end, None), (max(num, shared_end), len(toks), salt)):
            if hi > lo:
                leaf = TreeNode(next(self._ids), toks[lo:hi], pages[lo // ps : hi // ps], node, self._clock,
                                scope=scope)
                node.children[_key(node, scope, leaf.tokens[:ps])] = leaf
                node = leaf
        self._owned.update(new_pages)
        self._evictable += len(new_pages)
        return num

    def _walk(self, toks: Tokens, pages_out: list[int] | None, salt: str, shared_end: int,
              create: bool) -> tuple[TreeNode, int]:
        """Follow ``toks`` down whole pages (the first ``shared_end`` tokens in the shared tree, then
        the tenant ``salt``'s); split where the match ends inside a node."""
        ps = self.page_size
        end = len(toks) - len(toks) % ps
        self._clock += 1
        node, pos = self._root_for(None if shared_end else salt, create), 0
        while pos < end:
            scope = None if pos < shared_end else salt
            child = node.children.get(_key(node, scope, toks[pos:pos + ps]))
            if child is None:
                break
            n = _common_pages(child.tokens, toks, pos, shared_end if scope is None else end, ps)
            partial = n < len(child.pages)
            if partial:
                child = self._split(child, n)
            child.last_access = self._clock
            if pages_out is not None:
                pages_out.extend(child.pages)
            pos += len(child.tokens)
            node = child
            if partial:
                break
        return node, pos

    def _split(self, child: TreeNode, n_pages: int) -> TreeNode:
        """Cut ``child`` after ``n_pages``; the new prefix node takes its place, ``child`` keeps
        its identity (lock holders point at the deeper end) and becomes the suffix."""
        ps, k = self.page_size, n_pages * self.page_size
        parent = child.parent
        assert parent is not None and 0 < n_pages < len(child.pages)
        head = TreeNode(next(self._ids), child.tokens[:k], child.pages[:n_pages], parent,
                        child.last_access, child.lock_ref, scope=child.scope)
        parent.children[_key(parent, head.scope, head.tokens[:ps])] = head
        child.tokens = child.tokens[k:]
        child.pages = child.pages[n_pages:]
        child.parent = head
        head.children[_key(head, child.scope, child.tokens[:ps])] = child
        return head

    # ------------------------------------------------------------------ locks

    def lock(self, node: TreeNode) -> None:
        self._check_attached(node)
        while not self._is_root(node):
            if node.lock_ref == 0:
                self._evictable -= len(node.pages)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: TreeNode) -> None:
        self._check_attached(node)
        if not self._is_root(node) and node.lock_ref <= 0:
            raise RuntimeError(f"unlock of an unlocked node {node!r}")
        while not self._is_root(node):
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.pages)
            node = node.parent  # type: ignore[assignment]

    def _check_attached(self, node: TreeNode) -> None:
        """A node must hang below one of the live roots; a root itself always passes (locking one is
        a no-op, and a miss's root may be one that was never kept or has been dropped since)."""
        n: TreeNode | None = node
        while n is not None and not self._is_root(n):
            n = n.parent
        if n is None or (n is not node and self._roots.get(n.scope) is not n):
            raise ValueError(f"{node!r} is not in this radix cache (evicted or reset?)")

    # ------------------------------------------------------------------ eviction

    def evict(self, num_pages: int) -> int:
        """Evict least-recently-used unlocked leaves (a parent becomes a candidate once its
        children are gone) until ``num_pages`` pages were released or nothing evictable is left.

        Whole nodes only, so it may release more than asked. ``on_evict`` runs once, before any
        page is released, with the victims in eviction order (children before parents); if it
        raises, nothing is evicted. It is not called when nothing is evicted."""
        if num_pages <= 0:
            return 0
        heap = [(n.last_access, n.node_id, n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        victims: list[TreeNode] = []
        gone: dict[TreeNode, int] = {}  # evicted children per parent, to spot new leaves
        released = 0
        while heap and released < num_pages:
            node = heapq.heappop(heap)[2]
            victims.append(node)
            released += len(node.pages)
            parent = node.parent
            assert parent is not None
            if not self._is_root(parent):
                gone[parent] = gone.get(parent, 0) + 1
                if gone[parent] == len(parent.children) and parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        if not victims:
            return 0
        if self.on_evict is not None:
            self.on_evict(self._describe(victims))
        ps = self.page_size
        for node in victims:
            parent = node.parent
            assert parent is not None and not node.children
            del parent.children[_key(parent, node.scope, node.tokens[:ps])]
            node.parent = None
            self.allocator.decref(node.pages)
            self._owned.difference_update(node.pages)
            self._evictable -= len(node.pages)
            if not parent.children and parent is not self._root and self._roots.get(parent.scope) is parent:
                del self._roots[parent.scope]  # the salt's last node: its tree goes (module notes)
        return released

    def _describe(self, victims: list[TreeNode]) -> list[EvictedNode]:
        # node -> tokens from the root to the node's end, memoised so that victims sharing
        # ancestors walk each path once; the salt is the victim's own scope ("" for a shared node:
        # its pages are keyed in the shared namespace whatever the salt)
        paths: dict[TreeNode, Tokens] = {r: () for r in self._roots.values()}

        def path_of(node: TreeNode) -> Tokens:
            chain: list[TreeNode] = []
            n = node
            while n not in paths:
                chain.append(n)
                n = n.parent  # type: ignore[assignment]
            acc = paths[n]
            for a in reversed(chain):
                acc = acc + a.tokens
                paths[a] = acc
            return acc

        return [EvictedNode(path_of(v.parent), v.tokens, list(v.pages), v.scope or "")  # type: ignore[arg-type]
                for v in victims]

    # ------------------------------------------------------------------ accounting

    def evictable_pages(self) -> int:
        return self._evictable

    def total_pages(self) -> int:
        return len(self._owned)

    @property
    def hit_rate(self) -> float:
        return self.tokens_hit / self.tokens_requested if self.tokens_requested else 0.0

    def reset(self) -> None:
        """Drop every node and release the tree's page refs; zero the hit statistics.

        No eviction hook runs (nothing is offloaded). Raises RuntimeError while any node is
        locked, since lock holders would point into the dropped tree."""
        if any(c.lock_ref for r in self._roots.values() for c in r.children.values()):
            raise RuntimeError("reset() while nodes are locked")
        for node in self._nodes():
            self.allocator.decref(node.pages)
            node.parent = None
        self._root = TreeNode(next(self._ids), (), [], None, 0)
        self._roots = {"": self._root}
        self._owned.clear()
        self._evictable = 0
        self.tokens_requested = 0
        self.tokens_hit = 0

    def _nodes(self) -> list[TreeNode]:
        """Every node except the root, parents before children."""
        out: list[TreeNode] = []
        stack = [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def check_integrity(self) -> None:
        """Walk the whole tree; raise AssertionError on any broken invariant (engine/radix_check.py)."""
        from engine.radix_check import check_integrity

        check_integrity(self)


def _common_pages(node_tokens: Tokens, toks: Tokens, pos: int, end: int, ps: int) -> int:
    """How many whole pages of ``node_tokens`` equal ``toks[pos:end]`` from the start. The first
    page is known to match (it is the child's key). One C-level compare in the common case."""
    n = min(len(node_tokens), end - pos)
    if node_tokens[:n] == toks[pos:pos + n]:
        return n // ps
    for i in range(ps, n, ps):
        if node_tokens[i:i + ps] != toks[pos + i:pos + i + ps]:
            return i // ps
    raise AssertionError("unreachable: the whole slices differ but no page does")
