"""Usage when the prefix a request brings was not all there at its last lookup: a queued request
that gave its loaded prefix back and matched it again in the radix tree, or one that took a longer
prefix from the radix tree after its load. The loaded pages keep their tier, every page one outcome."""

from __future__ import annotations

from connector.attribution import DaemonView
from connector.state import KVState
from engine.request import PromptUsage

PS = 16


def _outcomes(usage: PromptUsage) -> dict:
    return {(p.reason, p.tier): p.pages for p in usage.pages}


def test_a_prefix_loaded_then_matched_again_counts_as_loaded_from_its_tier() -> None:
    # 8 pages: the first lookup saw 7 in cpu and all 7 loaded; the request gave them back, matched
    # them again in the radix tree, and its second start had nothing left to look up
    st = KVState(page_size=PS, view=DaemonView(["cpu"] * 7, [None] * 7), view_page=0, loaded_tiers=["cpu"] * 7,
                 last_loaded=7)
    usage = st.account(PromptUsage(128, radix=0, loaded=7 * PS))
    assert usage.loaded_tier == "cpu"
    assert _outcomes(usage) == {("loaded", "cpu"): 7, ("tail", None): 1}


def test_a_longer_radix_prefix_taken_after_the_load() -> None:
    # the lookup after a 0-page match saw 7 pages in disk; 3 were loaded, then the radix tree offered
    # 5 pages (2 more than the request held): radix 2, loaded 3, the daemon's last 2 bypassed
    st = KVState(page_size=PS, view=DaemonView(["disk"] * 7, [None] * 7), view_page=0, loaded_tiers=["disk"] * 3,
                 last_loaded=3)
    usage = st.account(PromptUsage(128, radix=2 * PS, loaded=3 * PS))
    assert _outcomes(usage) == {("radix", None): 2, ("loaded", "disk"): 3, ("bypassed", "disk"): 2, ("tail", None): 1}


def test_the_plain_case_is_what_the_lookup_saw() -> None:
    from connector.cost_model import Decision

    st = KVState(page_size=PS, view=DaemonView(["cpu"] * 4 + [None] * 2, ["cpu"] * 4 + [None, "disk"]),
                 view_page=1, loaded_tiers=["cpu"] * 2, last_loaded=2)
    st.decision = Decision(4, "load_all", "cpu", 0.0, 0.0, 1.0)
    usage = st.account(PromptUsage(128, radix=PS, loaded=2 * PS))  # 2 of the 4 planned arrived
    assert _outcomes(usage) == {("radix", None): 1, ("loaded", "cpu"): 2, ("read_failed", "cpu"): 2,
                                ("absent", None): 1, ("evicted", "disk"): 1, ("tail", None): 1}
