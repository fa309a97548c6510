"""The invariants of a RadixCache, walked in full: for tests and debugging, never on the hot path.

A friend of engine/radix_cache.py (it reads the tree's private bookkeeping): every node's parent
link, page count and key; page ownership against the allocator and the tree's owned-page set;
lock counts along the paths; the evictable-page counter; and the tenant rules of the shared
namespace (a shared node holds declared tokens only; a tenant's node never holds a declared page
and never hangs below another tenant's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.radix_cache import TreeNode, _key

if TYPE_CHECKING:
    from engine.radix_cache import RadixCache, Tokens

# ruff: noqa: SLF001 - the tree's own checker


def check_integrity(cache: RadixCache) -> None:
    """Walk the whole tree; raise AssertionError on any broken invariant."""
    ps = cache.page_size
    for root in cache._roots.values():
        if root.tokens or root.pages or root.parent is not None or root.lock_ref != 0:
            raise AssertionError("root must be empty, parentless and unlocked")
    seen: set[int] = set()
    evictable = 0
    stack: list[tuple[TreeNode, Tokens]] = [(r, ()) for r in cache._roots.values()]
    while stack:
        node, path = stack.pop()
        child_locks = 0
        for key, child in node.children.items():
            where = f"node {child.node_id}"
            if child.parent is not node:
                raise AssertionError(f"{where}: parent link broken")
            if not child.tokens or len(child.tokens) % ps:
                raise AssertionError(f"{where}: {len(child.tokens)} tokens, not a positive multiple of {ps}")
            if len(child.pages) * ps != len(child.tokens):
                raise AssertionError(f"{where}: {len(child.pages)} pages for {len(child.tokens)} tokens")
            if key != _key(node, child.scope, child.tokens[:ps]):
                raise AssertionError(f"{where}: key {key} != first page {child.tokens[:ps]}")
            _check_scope(cache, node, child, path)
            if child.lock_ref < 0:
                raise AssertionError(f"{where}: lock_ref {child.lock_ref} < 0")
            for p in child.pages:
                if p in seen:
                    raise AssertionError(f"{where}: page {p} owned twice")
                seen.add(p)
                if cache.allocator.refcount(p) <= 0:
                    raise AssertionError(f"{where}: page {p} owned by the tree but free in the allocator")
            if child.lock_ref == 0:
                evictable += len(child.pages)
            child_locks += child.lock_ref
            stack.append((child, path + child.tokens))
        if not cache._is_root(node) and node.lock_ref < child_locks:
            raise AssertionError(f"node {node.node_id}: lock_ref {node.lock_ref} < children's {child_locks}")
    if seen != cache._owned:
        raise AssertionError(f"owned-page set out of date: walk {len(seen)} vs counter {len(cache._owned)}")
    if evictable != cache._evictable:
        raise AssertionError(f"evictable pages: walk {evictable} vs counter {cache._evictable}")

def _check_scope(cache: RadixCache, node: TreeNode, child: TreeNode, path: Tokens) -> None:
    """A shared node holds declared tokens only, below the shared root or another shared node; a
    tenant's node starts past the declared tokens and stays below its own tenant's nodes."""
    where, shared_end = f"node {child.node_id}", cache._shared_end(path + child.tokens)
    if child.scope is None:
        if node.scope is not None:
            raise AssertionError(f"{where}: a shared node below tenant {node.scope!r}'s node")
        if shared_end < len(path) + len(child.tokens):
            raise AssertionError(f"{where}: a shared node holds tokens outside every declared prefix")
    else:
        if node.scope is not None and node.scope != child.scope:
            raise AssertionError(f"{where}: tenant {child.scope!r}'s node below tenant {node.scope!r}'s")
        if node is cache._roots.get(None) or shared_end > len(path):
            raise AssertionError(f"{where}: tenant {child.scope!r}'s node holds declared shared pages")
