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
