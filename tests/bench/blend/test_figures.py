"""How bench.blend computes its figures (bench/blend/figures.py), on synthetic inputs: no model.

Each figure has a case where it must come out low or false, so none of them can only flatter."""

from __future__ import annotations

import pytest

from bench.blend.data import ANSWER_VOCAB
from bench.blend.figures import (
    MIN_ANSWER_AGREEMENT,
    MIN_CONTINUATION_F1,
    answer_agreement,
    answer_terms,
    beats,
    best_ratio,
    default_ratio,
    lcs_f1,
    lcs_len,
    mean_ci,
    median_timing,
    selection_ge_random_every_r,
    trim_at_eos,
)
from bench.blend.run import curve_of, method_names, verdict


def test_lcs_len():
    assert lcs_len([1, 2, 3, 4], [1, 3, 4]) == 3
    assert lcs_len([1, 2, 3], [3, 2, 1]) == 1
    assert lcs_len([], [1]) == 0
    assert lcs_len([5, 6, 5, 6], [6, 5, 6, 5]) == 3


def test_lcs_f1_values():
    assert lcs_f1([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert lcs_f1([1, 2, 3, 4], [5, 6, 7, 8]) == 0.0  # nothing in common: must be able to reach 0
    # L = 2, P = 2/2, R = 2/4 -> F1 = 2/3: a truncated continuation is not a match
    assert lcs_f1([1, 2, 3, 4], [1, 2]) == pytest.approx(2 / 3)
    assert lcs_f1([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(0.25)  # order matters (not a bag of tokens)
    assert lcs_f1([], []) == 1.0
    assert lcs_f1([1], []) == 0.0


def test_trim_at_eos_keeps_the_first_eos_only():
    assert trim_at_eos([5, 6, 2, 7, 2], [2]) == [5, 6, 2]
    assert trim_at_eos([5, 6], [2]) == [5, 6]
    assert trim_at_eos([0, 5], [0, 2]) == [0]
    # what follows EOS does not count: two continuations that differ only after it score 1.0
    assert lcs_f1(trim_at_eos([5, 2, 9, 9], [2]), trim_at_eos([5, 2, 8, 8], [2])) == 1.0


def test_answer_terms_in_order_whole_words_longest_first():
    text = "Ada Brandt lives in Sorrento Vale, famous for a copper clock tower; 12,000 people. Teal."
    assert answer_terms(text, ANSWER_VOCAB) == ["sorrento vale", "copper clock tower", "12000", "teal"]
    assert answer_terms("the lighthouse keeper", ANSWER_VOCAB) == ["lighthouse keeper"]  # not "lighthouse"
    assert answer_terms("Cobaltine", ["cobalt", "Cobaltine"]) == ["cobaltine"]
    assert answer_terms("cobaltish", ["cobalt"]) == []  # whole words only
    assert answer_terms("nothing here", ANSWER_VOCAB) == []
    assert answer_terms("on the 40th day, 3rd of 21st", ANSWER_VOCAB) == ["40", "3", "21"]  # ordinals


def test_answer_agreement_compares_the_first_two_terms():
    ref = "Her favourite colour is teal and she works as a potter."
    assert answer_agreement(ref, "The colour is TEAL; she is a potter by trade, in Orvik.", ANSWER_VOCAB)
    assert not answer_agreement(ref, "Her favourite colour is crimson and she works as a potter.", ANSWER_VOCAB)
    assert not answer_agreement(ref, "She works as a potter and her colour is teal.", ANSWER_VOCAB)  # order
    assert not answer_agreement(ref, "Her favourite colour is teal.", ANSWER_VOCAB)  # one fact missing
    assert not answer_agreement(ref, "I do not know.", ANSWER_VOCAB)
    assert answer_agreement("On day 12 they had 7 days of water.", "Day 12: 7 days of water left", ANSWER_VOCAB)
    assert not answer_agreement("On day 12 they had 7 days of water.", "On day 12 they had 8.", ANSWER_VOCAB)
    # the reference naming nothing is agreed with only by a method naming nothing
    assert answer_agreement("I cannot tell.", "No idea.", ANSWER_VOCAB)
    assert not answer_agreement("I cannot tell.", "It is teal.", ANSWER_VOCAB)


def _pt(f1: float, agree: float) -> dict[str, float]:
    return {"continuation_f1": f1, "answer_agreement": agree}


def test_default_ratio_is_the_smallest_r_meeting_both_bars():
    curve = {0.0: _pt(0.5, 0.6), 0.05: _pt(0.85, 0.85), 0.15: _pt(0.81, 0.92), 0.3: _pt(0.9, 0.95),
             1.0: _pt(1.0, 1.0)}
    assert default_ratio(curve) == 0.15  # 0.05 misses agreement; F1 at 0.15 just clears 0.8
    assert default_ratio({0.0: _pt(0.79, 1.0), 0.3: _pt(0.8, 0.89), 1.0: _pt(1.0, 1.0)}) == 1.0  # nothing below 1
    assert default_ratio({0.0: _pt(MIN_CONTINUATION_F1, MIN_ANSWER_AGREEMENT), 1.0: _pt(1, 1)}) == 0.0
    with pytest.raises(ValueError, match="quality threshold"):
        default_ratio({0.0: _pt(0.1, 0.1), 0.5: _pt(0.5, 0.5)})


def test_beats_needs_a_gain_beyond_noise():
    base = [0.5, 0.6, 0.4, 0.55, 0.45, 0.5, 0.6, 0.4]
    better = [x + 0.2 for x in base]
    agree = [1.0] * 8
    assert beats(better, base, agree, agree)
    assert not beats(base, base, agree, agree)  # identical methods (e.g. r = 1 vs random at r = 1)
    assert not beats(base, better, agree, agree)  # worse
    # same mean gain but one case carries it all: not clear of two standard errors
    lucky = base[:-1] + [base[-1] + 1.6]
    assert not beats(lucky, base, agree, agree)
    # a clear F1 gain with a lower answer agreement does not count
    assert not beats(better, base, [0.0] + agree[1:], agree)
    assert not beats([x + 0.005 for x in base], base, agree, agree)  # below MIN_F1_GAIN
    with pytest.raises(ValueError):
        beats([1.0], [1.0, 0.5], [1.0], [1.0, 1.0])


def test_mean_ci_and_best_ratio():
    m, lo, hi = mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and lo < 2.0 < hi and hi - 2.0 == pytest.approx(1.96 / 3**0.5)
    assert mean_ci([0.5])[2] == float("inf")  # one case says nothing about the spread
    with pytest.raises(ValueError):
        mean_ci([])
    curve = {0.0: _pt(0.9, 1.0), 0.15: _pt(0.7, 0.5), 0.3: _pt(0.75, 0.6), 1.0: _pt(1.0, 1.0)}
    assert best_ratio(curve) == (0.3, False)  # reuse_0 and r = 1 are never the best r
    curve[0.15] = _pt(0.85, 0.95)
    assert best_ratio(curve) == (0.15, True)
    assert best_ratio({0.0: _pt(1, 1), 1.0: _pt(1, 1)}) == (None, False)
    assert selection_ge_random_every_r({}) is None


def test_median_timing():
    assert median_timing([(3.0, 1.0), (1.0, 9.0), (2.0, 2.0)]) == {"wall_s": 2.0, "cpu_s": 2.0, "reps": 3}
    with pytest.raises(ValueError):
        median_timing([])


def _stats(f1: list[float], agree: list[float]) -> dict[str, list[float]]:
    return {"f1": f1, "agree": agree, "kl": [0.1] * len(f1)}


def test_curve_and_verdict_from_per_case_figures():
    """bench.blend's own plumbing: the curve takes random at r = 0 / 1 from reuse_0 / blend_1.0 and
    the booleans come from the paired cases at the default ratio."""
    n = 6
    per = {"reuse_0": (0.4, 0.5), "blend_0.05": (0.6, 0.7), "random_0.05": (0.45, 0.5),
           "blend_0.15": (0.85, 0.95), "random_0.15": (0.5, 0.6), "blend_0.3": (0.9, 1.0),
           "random_0.3": (0.6, 0.7), "blend_0.5": (0.95, 1.0), "random_0.5": (0.7, 0.8), "blend_1.0": (1.0, 1.0)}
    wiggle = [0.0, 0.01, -0.01, 0.02, -0.02, 0.0]
    stats = {m: _stats([f + w for w in wiggle], [a] * n) for m, (f, a) in per.items()}
    summary = {m: {"continuation_f1": f, "answer_agreement": a, "kl": 0.0, "recomputed_share": 0.0,
                   "compute_share": 0.0} for m, (f, a) in per.items()}
    curve = curve_of(summary)
    assert curve[0.0]["random_continuation_f1"] == 0.4 and curve[1.0]["random_answer_agreement"] == 1.0
    v = verdict(stats, curve)
    assert v["default_ratio"] == v["best_ratio"] == 0.15 and v["best_ratio_meets_bar"]
    assert v["blend_beats_reuse0"] and v["blend_beats_random"] and v["selection_ge_random_every_r"]
    assert set(v["selection_vs_random"]) == {"0.05", "0.15", "0.3", "0.5"}
    # when only r = 1 meets the bar the default stays exact, but the verdicts are taken at the best
    # r < 1 (0.5, the highest F1), never at 1.0 where random is the same method
    for m in per:
        if m != "blend_1.0":
            summary[m]["answer_agreement"] = 0.5
    v = verdict(stats, curve_of(summary))
    assert v["default_ratio"] == 1.0 and v["best_ratio"] == 0.5 and not v["best_ratio_meets_bar"]
    assert v["blend_beats_reuse0"] and v["blend_beats_random"]
    # random ahead at one r: the every-r verdict fails, with the difference's interval below 0
    stats["random_0.3"] = _stats([0.95 + w for w in wiggle], [1.0] * n)
    v = verdict(stats, curve)
    assert not v["selection_ge_random_every_r"] and v["selection_vs_random"]["0.3"]["f1_diff"][2] < 0
    # the paired KL difference: ours closer to full prefill's next token than random at every case
    stats["blend_0.3"]["kl"] = [0.05 + w / 10 for w in wiggle]
    row = verdict(stats, curve)["selection_vs_random"]["0.3"]
    assert row["kl_diff"][0] == pytest.approx(-0.05) and row["kl_diff"][2] < 0
    assert row["random_kl"][0] == pytest.approx(0.1)
    assert method_names(0.15) == ("blend_0.15", "random_0.15") and method_names(0.0) == ("reuse_0", "reuse_0")
