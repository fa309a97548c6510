"""How closely two greedy continuations agree: F1 of their longest common subsequence of tokens.

One definition for the blending quality gate (live, blended vs full prefill) and for bench.blend's
continuation figure, so the gate's threshold and the bench's curve mean the same thing.
"""

from __future__ import annotations

from collections.abc import Sequence


def lcs_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common subsequence (order matters, gaps allowed)."""
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def lcs_f1(reference: Sequence[int], hypothesis: Sequence[int]) -> float:
    """2·LCS / (len(reference) + len(hypothesis)): 1.0 when both are empty, 0.0 with nothing shared."""
    if not reference and not hypothesis:
        return 1.0
    return 2 * lcs_len(reference, hypothesis) / (len(reference) + len(hypothesis))
