"""Why did it miss: each prompt page gets exactly one cache outcome, from what the connector saw.

A prompt of ``n`` tokens has ``ceil(n / page_size)`` pages. In page order:

- ``radix``: the engine's own radix tree held it (exact, shared with earlier requests);
- ``loaded`` (tier): loaded from the daemon, from that tier;
- ``read_failed`` (tier): the cost model chose to load it but the load was cut short at or before
  it (checksum, block gone, deadline, daemon error, no free pool page): recomputed;
- ``bypassed`` (tier): the daemon held it, but the cost model judged loading it slower than
  recomputing it (connector/cost_model.py);
- ``after_gap`` (tier): the daemon holds it, but an earlier page is missing; KV is only usable as
  a contiguous prefix, so it is recomputed;
- ``evicted`` (tier): absent from the daemon, and that tier evicted it lately (a ghost,
  kvstore/store/miss_reasons.py): a bigger tier would have hit;
- ``absent``: absent, and no tier remembers it (never stored, evicted long ago, or deleted);
- ``unavailable``: the daemon was not asked (a lookup failed, or within the back-off after one);
- ``tail``: the page holding the prompt's last token: always computed (its logits start the output).

What supplied a missed page instead (plain prefill, or CacheBlend's approximate KV) is in the
usage's token split (``PromptUsage.cached_by_source``/``computed_by_source``), not here.

Tenant mismatch (the same tokens cached under another ``cache_salt``) is deliberately not an
outcome: telling one tenant that another holds its prompt is the prefix-cache side channel that
salts exist to close, and a hook may not read the radix tree anyway (engine/hooks.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from engine.request import PageOutcome


class DaemonView(NamedTuple):
    """What one lookup said about the pages after the radix match (one entry per page)."""

    tiers: Sequence[str | None]  # the tier holding each page (None: absent)
    evicted_from: Sequence[str | None]  # for an absent page: the tier that evicted it lately

    @property
    def prefix(self) -> int:
        return next((i for i, t in enumerate(self.tiers) if t is None), len(self.tiers))


#: the daemon was not asked
UNAVAILABLE = DaemonView((), ())


def attribute(prompt_tokens: int, page_size: int, radix_tokens: int, loaded_tokens: int,
              view: DaemonView | None, planned_pages: int) -> tuple[PageOutcome, ...]:
    """Outcomes of every prompt page, grouped as (reason, tier) runs in first-seen order.

    ``radix_tokens`` and ``loaded_tokens`` are the scheduler's figures (page-aligned);
    ``view`` covers the loadable pages after the radix match (None: there were none to look up);
    ``planned_pages`` is how many of them the cost model chose to load."""
    if page_size <= 0 or prompt_tokens <= 0:
        raise ValueError(f"attribution needs a prompt and a page size (got {prompt_tokens}, {page_size})")
    radix, loaded = radix_tokens // page_size, loaded_tokens // page_size
    loadable = (prompt_tokens - 1) // page_size  # the last token is always computed
    per_page: list[tuple[str, str | None]] = [("radix", None)] * radix
    prefix = view.prefix if view is not None else 0
    for j in range(loadable - radix):
        if view is UNAVAILABLE:
            per_page.append(("unavailable", None))
            continue
        tier = view.tiers[j] if view is not None and j < len(view.tiers) else None
        if j < loaded:
            per_page.append(("loaded", tier))
        elif j < planned_pages:
            per_page.append(("read_failed", tier))
        elif j < prefix:
            per_page.append(("bypassed", tier))
        elif tier is not None:
            per_page.append(("after_gap", tier))
        else:
            ghost = view.evicted_from[j] if view is not None and j < len(view.evicted_from) else None
            per_page.append(("evicted", ghost) if ghost is not None else ("absent", None))
    per_page.append(("tail", None))
    counts: dict[tuple[str, str | None], int] = {}
    for outcome in per_page:
        counts[outcome] = counts.get(outcome, 0) + 1
    return tuple(PageOutcome(reason, tier, n) for (reason, tier), n in counts.items())
