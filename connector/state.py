"""What the KV connector keeps per request, in the request's declared ``kv`` slot."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from connector.cost_model import Decision
from engine.request import HookState, PromptUsage
from kvstore.keys import BlockKey


@dataclass
class KVState(HookState):
    keys: list[BlockKey] = field(default_factory=list)  # chained keys of the full pages, computed once
    decision: Decision | None = None  # the cost model's last decision for this request
    load_s: float = 0.0  # measured seconds of that load (0: nothing loaded)

    def account(self, usage: PromptUsage) -> PromptUsage:
        """Usage names the tier that held most of the pages loaded (the cost model's decision)."""
        if usage.loaded and self.decision is not None and self.decision.pages:
            return replace(usage, loaded_tier=self.decision.tier)
        return usage
