"""Incremental detokenisation: each new token decodes a window of a few tokens, never the whole output.

Decoding the whole output again for every token costs time proportional to the output, on the step
thread. Instead (as vLLM and TGI do) a request keeps two offsets into its output ids: ``prefix_offset``
.. ``read_offset`` are the tokens of the last piece of text emitted, kept as context, and the tokens
after ``read_offset`` are not emitted yet. A step decodes the context alone and the context plus the
new tokens; the text the new tokens add is the difference. The context makes the difference right for
tokenizers whose decoding of a token depends on its neighbour (SentencePiece's leading space); for
byte-level BPE (the bundled SmolLM2) the pieces join to exactly the text a full decode gives.

Text that ends in U+FFFD (half a UTF-8 character, its other bytes still to come) is not emitted: the
tokens stay pending until the character is whole. A run of more than ``MAX_PENDING`` pending tokens
(no legitimate character needs that many; a model emitting only invalid bytes or skipped special
tokens) is emitted as it decodes, so the window stays bounded whatever the model generates.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: pending tokens after which text is emitted even if it ends in half a character (a UTF-8 character is
#: at most 4 bytes, each token at least one)
MAX_PENDING = 8
REPLACEMENT = "\ufffd"


class Detokenizer:
    """One request's detokenisation window (its offsets into the output ids and the context's text)."""

    __slots__ = ("tokenizer", "prefix_offset", "read_offset", "_prefix_text", "pending")

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.prefix_offset = 0  # ids[prefix_offset:read_offset]: the context (the last emitted piece's tokens)
        self.read_offset = 0  # ids[read_offset:]: not emitted yet
        self._prefix_text: str | None = ""  # decode of the context (None: not decoded yet)
        self.pending = ""  # what the tokens past read_offset decode to so far, while it may not be emitted

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def step(self, ids: Sequence[int], end: int, final: bool) -> str:
        """The text ``ids[read_offset:end]`` adds, if it may be emitted now ("" otherwise, and
        ``pending`` holds it, a half character at its end); ``final`` (the request finishes at ``end``)
        emits whatever they decode to, half characters included. Decodes at most
        ``end - prefix_offset`` tokens: the last piece's plus the pending ones."""
        self.pending = ""
        if end <= self.read_offset:
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(ids[self.prefix_offset:self.read_offset])
        prefix = self._prefix_text
        text = self._decode(ids[self.prefix_offset:end])
        overdue = final or end - self.read_offset >= MAX_PENDING
        if len(text) > len(prefix) and (overdue or not text.endswith(REPLACEMENT)):
            new = text[len(prefix):]
        elif overdue:  # nothing to show for them (special tokens skipped): move on all the same
            new = ""
        else:
            self.pending = text[len(prefix):]
            return ""
        self.prefix_offset, self.read_offset, self._prefix_text = self.read_offset, end, None
        return new
