"""What the KV connector keeps per request, under its key (``SLOT``) in ``Request.extras``."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field, replace

from connector.attribution import UNAVAILABLE, DaemonView, attribute
from connector.cost_model import Decision
from connector.fetch import Fetch
from engine.request import HookState, PromptUsage, Request
from kvstore.keys import BlockKey

log = logging.getLogger(__name__)

SLOT = "tierkv"  # the connector's key in Request.extras


@dataclass
class KVState(HookState):
    keys: list[BlockKey] = field(default_factory=list)  # chained keys of the full pages, computed once
    decision: Decision | None = None  # the cost model's last decision for this request
    load_s: float = 0.0  # measured seconds of that load (0: nothing loaded)
    page_size: int = 0  # set when the connector looked at the request (0: it did not)
    view: DaemonView | None = None  # what the daemon said about the pages after the radix match
    view_page: int = 0  # the prompt page ``view`` starts at (the radix match at the lookup)
    fetch: Fetch | None = None  # the load in flight while the request is LOADING (connector/fetch.py)
    loaded_tiers: list[str | None] = field(default_factory=list)  # tier of each page loaded, every fetch
    last_loaded: int = 0  # pages the last fetch loaded

    def account(self, usage: PromptUsage) -> PromptUsage:
        """Usage names the tier that held most of the pages loaded, and why each prompt page hit or
        missed (connector/attribution.py).

        The scheduler's split can start elsewhere than the last lookup's view: a queued request that
        gave its loaded prefix back matched it again in the radix tree (its first fetch's pages count
        as loaded, before the view), or took a longer prefix from the radix tree after its load. The
        view is realigned to start after the radix pages: the loaded pages' tiers, then what the
        lookup said of the pages after everything radix and loads supplied."""
        ps = self.page_size
        loaded = usage.loaded // ps if ps else 0
        tiers = self.loaded_tiers[-loaded:] if loaded else []
        if tiers:
            usage = replace(usage, loaded_tier=Counter(tiers).most_common(1)[0][0])
        if not ps:
            return usage
        view, planned = self.view, self.decision.pages if self.decision is not None else 0
        skip = usage.radix // ps + loaded - self.view_page  # view entries the radix and loaded pages cover
        if view is not None and view is not UNAVAILABLE and skip >= 0 and len(tiers) == loaded:
            view = DaemonView([*tiers, *view.tiers[skip:]], [None] * loaded + list(view.evicted_from[skip:]))
            planned = loaded + max(planned - self.last_loaded, 0)
        try:
            pages = attribute(usage.prompt_tokens, ps, usage.radix, usage.loaded, view, planned)
            return replace(usage, page_size=self.page_size, pages=pages)
        except ValueError as e:  # never fail a request over its accounting
            log.error("page attribution skipped: %s", e)
            return usage


def kv_state(req: Request) -> KVState | None:
    """The connector's state of ``req`` (None: the connector never looked at it)."""
    st = req.extras.get(SLOT)
    assert st is None or isinstance(st, KVState)
    return st
