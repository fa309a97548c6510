"""What the KV connector keeps per request, in the request's declared ``kv`` slot."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from connector.attribution import DaemonView, attribute
from connector.cost_model import Decision
from connector.fetch import Fetch
from engine.request import HookState, PromptUsage
from kvstore.keys import BlockKey

log = logging.getLogger(__name__)


@dataclass
class KVState(HookState):
    keys: list[BlockKey] = field(default_factory=list)  # chained keys of the full pages, computed once
    decision: Decision | None = None  # the cost model's last decision for this request
    load_s: float = 0.0  # measured seconds of that load (0: nothing loaded)
    page_size: int = 0  # set when the connector looked at the request (0: it did not)
    view: DaemonView | None = None  # what the daemon said about the pages after the radix match
    fetch: Fetch | None = None  # the load in flight while the request is LOADING (connector/fetch.py)

    def account(self, usage: PromptUsage) -> PromptUsage:
        """Usage names the tier that held most of the pages loaded (the cost model's decision),
        and why each prompt page hit or missed (connector/attribution.py)."""
        if usage.loaded and self.decision is not None and self.decision.pages:
            usage = replace(usage, loaded_tier=self.decision.tier)
        if not self.page_size:
            return usage
        planned = self.decision.pages if self.decision is not None else 0
        try:
            pages = attribute(usage.prompt_tokens, self.page_size, usage.radix, usage.loaded, self.view, planned)
            return replace(usage, page_size=self.page_size, pages=pages)
        except ValueError as e:  # never fail a request over its accounting
            log.error("page attribution skipped: %s", e)
            return usage
