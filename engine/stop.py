"""Stop rules and streamed text: EOS, stop token ids, stop strings, max_tokens.

Streaming text must never show part of a stop string or half a UTF-8 character, so the checker
holds back a tail that could still turn into either. All of it costs a bounded amount per token,
whatever the output's length, on the step thread:

- detokenisation decodes a window of a few tokens (engine/detokenizer.py), never the whole output;
- a stop string can only appear where the new text completes it, so the search runs over the held
  tail plus the new text (at most the longest stop string plus the new text);
- the hold-back is the longest tail of the text that is a proper prefix of some stop string, kept
  per stop string as a Knuth-Morris-Pratt state that each new character advances (amortised O(1)
  per character, at most O(longest stop string) for one token), not by comparing every prefix of
  every stop string with the text again.

The text is the one decoding the output ids in one go gives (for the bundled byte-level tokenizer
exactly), cut before the first stop string; a finishing request emits everything it holds.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from engine.detokenizer import Detokenizer
from engine.request import Request


class StopStrings:
    """A request's stop strings, compiled: each one's KMP failure table."""

    __slots__ = ("strings", "_fail")

    def __init__(self, strings: Sequence[str]) -> None:
        self.strings = tuple(strings)
        self._fail = tuple(_failure(s) for s in self.strings)

    def first(self, text: str) -> int:
        """Where the earliest stop string in ``text`` starts, or -1."""
        hits = [i for i in (text.find(s) for s in self.strings) if i >= 0]
        return min(hits) if hits else -1

    def advance(self, states: list[int], text: str) -> int:
        """Feed ``text`` (which completes no stop string) to the per-string states (how many leading
        characters of each stop string the text so far ends with); return the longest of them."""
        longest = 0
        for j, (s, fail) in enumerate(zip(self.strings, self._fail, strict=True)):
            k = states[j]
            for c in text:
                while k and s[k] != c:
                    k = fail[k - 1]
                if s[k] == c:
                    k += 1
                    if k == len(s):  # unreachable when ``text`` completes no stop string; stay sound
                        k = fail[k - 1]
            states[j] = k
            longest = max(longest, k)
        return longest


def _failure(s: str) -> list[int]:
    """fail[i]: length of the longest proper prefix of s[:i + 1] that is also its suffix."""
    fail = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


@functools.lru_cache(maxsize=64)  # at most ~20 KB each (8 strings of 256 characters and their tables)
def compile_stop(strings: tuple[str, ...]) -> StopStrings:
    """The compiled form of a tuple of stop strings (requests repeating a set share it)."""
    return StopStrings(strings)


class StopState:
    """One request's place in its output text: the detokeniser's window, the text decoded but held
    back (it may still become a stop string), and the stop strings' KMP states."""

    __slots__ = ("detok", "held", "states", "stop", "stop_ids")

    def __init__(self, tokenizer: Any, stop: tuple[str, ...], stop_ids: tuple[int, ...]) -> None:
        self.detok = Detokenizer(tokenizer)
        self.held = ""
        self.stop = compile_stop(stop) if stop else None
        self.states = [0] * len(stop)
        self.stop_ids = frozenset(stop_ids)


class StopChecker:
    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.eos = frozenset(eos_token_ids)

    def update(self, req: Request) -> tuple[str, str | None]:
        """Account for the request's newest token; return (text to emit now, finish reason or None)."""
        p = req.params
        st = req.stop_state
        if st is None:
            st = req.stop_state = StopState(self.tokenizer, p.stop, p.stop_token_ids)
        ids = req.output_ids
        tok, end = ids[-1], len(ids)
        reason: str | None = None
        if (tok in self.eos and not p.ignore_eos) or tok in st.stop_ids:
            reason, end = "stop", end - 1  # the stop token's own text is not output
        final = reason is not None or len(ids) >= p.max_tokens
        new = st.detok.step(ids, end, final)
        tail = st.held + new  # where a stop string may now appear: nothing before it can start one
        if st.stop is not None:  # (text not emittable yet counts too: a stop before a half character)
            cut = st.stop.first(tail + st.detok.pending)
            if cut >= 0:
                return self._emit(req, st, (tail + st.detok.pending)[:cut], ""), "stop"
        if reason is None and len(ids) >= p.max_tokens:
            reason = "length"
        if reason is not None or st.stop is None:
            return self._emit(req, st, tail, ""), reason
        hold = st.stop.advance(st.states, new)
        return self._emit(req, st, tail[: len(tail) - hold], tail[len(tail) - hold:]), None

    @staticmethod
    def _emit(req: Request, st: StopState, text: str, held: str) -> str:
        st.held = held
        if text:
            req.text_pieces.append(text)
        return text
