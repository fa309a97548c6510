"""How bench.blend turns generated tokens into figures: pure functions, unit-tested on synthetic
inputs (tests/bench/blend/test_figures.py).

continuation_f1
    LCS-F1 on tokens between a method's 32-token greedy continuation and full prefill's, both
    cut after the first end-of-sequence token: with L the longest common subsequence,
    P = L / len(method), R = L / len(reference), F1 = 2PR / (P + R) (1.0 when both are empty).
answer_agreement
    The answer terms of a continuation are, in order of appearance in its decoded text, the
    occurrences of the workload's answer vocabulary (bench.blend.data.ANSWER_VOCAB: colours, jobs,
    cities, landmarks, pets, places, crew names; case-insensitive, whole words) and of numbers
    (thousands separators and ordinal suffixes dropped: 'the 40th day' names 40).
    A method agrees with full prefill on a case when the first ANSWER_TERMS answer terms of its
    continuation equal (same strings, same order) the first ANSWER_TERMS of full prefill's —
    every question asks for two facts. Full prefill naming no term is agreed with only by a method
    naming none; ``answer_reference_rate`` (the share of cases where full prefill names at least
    one term) says how often the figure is vacuous.
default_ratio
    The smallest r on the curve whose continuation_f1 >= MIN_CONTINUATION_F1 and whose
    answer_agreement >= MIN_ANSWER_AGREEMENT (r = 1 is exact, so the curve always has one).
best_ratio
    Where the verdicts are taken: the smallest r strictly between 0 and 1 that meets the quality
    bar, else (``best_ratio_meets_bar`` false) the r < 1 with the highest continuation_f1 — never
    r = 1, where blend and every baseline recompute everything and agree by construction.
selection_vs_random
    Per r in (0, 1): the mean continuation_f1 (and KL) of our selection and of random selection
    of the same budget with 95% confidence intervals (normal, over cases), and the paired per-case
    differences (ours - random) of F1 and of KL with their intervals: a greedy 32-token F1 jumps
    once one token diverges, so at 30 cases its difference is mostly noise, while the paired KL
    says whether the selection moves the next-token distribution towards full prefill's.
    ``selection_ge_random_every_r``: the mean F1 difference is >= 0 at every such r (the verdict
    stays on F1).
beats
    Method A beats B on paired cases when the mean per-case continuation_f1 gain exceeds both
    MIN_F1_GAIN and two standard errors of the paired differences, and A's answer agreement is
    not lower.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence

from connector.blend.agreement import lcs_f1, lcs_len  # noqa: F401 - the bench's continuation figure

# The quality bar for a default ratio. Agreement: a RAG user sees the same facts as with full
# prefill in at least 9 answers out of 10. F1: the rest of the 32-token continuation keeps 80%
# of full prefill's tokens in order, so the text around the facts does not drift either.
MIN_ANSWER_AGREEMENT = 0.9
MIN_CONTINUATION_F1 = 0.8
ANSWER_TERMS = 2
# A gain smaller than this is not worth quoting even when it is statistically clear.
MIN_F1_GAIN = 0.01


def trim_at_eos(tokens: Sequence[int], eos: Iterable[int]) -> list[int]:
    """The tokens up to and including the first end-of-sequence token."""
    stop = set(eos)
    out: list[int] = []
    for t in tokens:
        out.append(t)
        if t in stop:
            break
    return out


_ORDINAL = re.compile(r"(?<=\d)(st|nd|rd|th)$")


def answer_terms(text: str, vocab: Iterable[str]) -> list[str]:
    """Answer-vocabulary terms and numbers in ``text``, lower-cased, in order of appearance
    (longest vocabulary entry first where entries overlap)."""
    words = sorted({v.lower() for v in vocab}, key=len, reverse=True)
    alts = [re.escape(w) for w in words] + [r"\d[\d,]*(?:st|nd|rd|th)?"]
    pat = re.compile(r"(?<![\w])(" + "|".join(alts) + r")(?![\w])", re.IGNORECASE)
    return [_ORDINAL.sub("", m.group(1).lower().replace(",", "")) for m in pat.finditer(text)]


def answer_agreement(reference: str, text: str, vocab: Iterable[str], terms: int = ANSWER_TERMS) -> bool:
    vocab = list(vocab)
    return answer_terms(reference, vocab)[:terms] == answer_terms(text, vocab)[:terms]


def meets_threshold(point: Mapping[str, float], min_f1: float = MIN_CONTINUATION_F1,
                    min_agreement: float = MIN_ANSWER_AGREEMENT) -> bool:
    return point["continuation_f1"] >= min_f1 and point["answer_agreement"] >= min_agreement


def default_ratio(curve: Mapping[float, Mapping[str, float]], min_f1: float = MIN_CONTINUATION_F1,
                  min_agreement: float = MIN_ANSWER_AGREEMENT) -> float:
    """The smallest r whose point meets the quality bar; ValueError when none does."""
    ok = [r for r, p in curve.items() if meets_threshold(p, min_f1, min_agreement)]
    if not ok:
        raise ValueError("no ratio on the curve meets the quality threshold (r = 1 should: is it missing?)")
    return min(ok)


def mean_ci(xs: Sequence[float], z: float = 1.96) -> list[float]:
    """[mean, low, high]: a normal 95% interval of the mean over cases (the half-width is infinite
    for one case: it says nothing)."""
    if not xs:
        raise ValueError("mean_ci needs at least one value")
    m = statistics.fmean(xs)
    h = z * statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else math.inf
    return [m, m - h, m + h]


def best_ratio(curve: Mapping[float, Mapping[str, float]], min_f1: float = MIN_CONTINUATION_F1,
               min_agreement: float = MIN_ANSWER_AGREEMENT) -> tuple[float | None, bool]:
    """(r, meets the bar) of the module doc; (None, False) when the curve has no r in (0, 1)."""
    inner = {r: p for r, p in curve.items() if 0 < r < 1}
    if not inner:
        return None, False
    ok = [r for r, p in inner.items() if meets_threshold(p, min_f1, min_agreement)]
    if ok:
        return min(ok), True
    return max(inner, key=lambda r: (inner[r]["continuation_f1"], -r)), False


def selection_vs_random(stats: Mapping[str, Mapping[str, Sequence[float]]],
                        pairs: Mapping[float, tuple[str, str]]) -> dict[str, dict[str, object]]:
    """Per r ({r: (our method, random method)}, 0 < r < 1): F1 and KL of both with intervals, and
    the paired F1 and KL differences (ours - random) with their intervals."""
    out: dict[str, dict[str, object]] = {}
    for r, (ours, rnd) in pairs.items():
        a, b = stats[ours], stats[rnd]
        d = [x - y for x, y in zip(a["f1"], b["f1"], strict=True)]
        dkl = [x - y for x, y in zip(a["kl"], b["kl"], strict=True)]
        out[f"{r:g}"] = {"cases": len(d), "f1": mean_ci(a["f1"]), "random_f1": mean_ci(b["f1"]),
                         "f1_diff": mean_ci(d), "kl": mean_ci(a["kl"]), "random_kl": mean_ci(b["kl"]),
                         "kl_diff": mean_ci(dkl)}
    return out


def selection_ge_random_every_r(table: Mapping[str, Mapping[str, object]]) -> bool | None:
    """True when our mean F1 is at least random's at every r of ``selection_vs_random``."""
    if not table:
        return None
    return all(row["f1_diff"][0] >= 0 for row in table.values())  # type: ignore[index]


def beats(f1_a: Sequence[float], f1_b: Sequence[float], agree_a: Sequence[float], agree_b: Sequence[float],
          min_gain: float = MIN_F1_GAIN) -> bool:
    """Paired per-case figures of methods A and B (see the module doc)."""
    if not (len(f1_a) == len(f1_b) == len(agree_a) == len(agree_b)) or not f1_a:
        raise ValueError("beats needs the same non-zero number of cases for both methods")
    d = [x - y for x, y in zip(f1_a, f1_b, strict=True)]
    gain = statistics.fmean(d)
    se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else math.inf
    return gain > max(min_gain, 2 * se) and statistics.fmean(agree_a) >= statistics.fmean(agree_b)


def median_timing(samples: Sequence[tuple[float, float]]) -> dict[str, float]:
    """(wall, cpu) samples -> medians and the count; ValueError on no samples."""
    if not samples:
        raise ValueError("no timing samples")
    return {"wall_s": statistics.median(s[0] for s in samples), "cpu_s": statistics.median(s[1] for s in samples),
            "reps": len(samples)}
