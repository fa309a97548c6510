"""Stop rules and incremental detokenisation: EOS, stop token ids, stop strings, max_tokens.

Streaming text must never show part of a stop string or half a UTF-8 character, so the
checker holds back a tail that could still turn into either.
"""

from __future__ import annotations

from typing import Any

from engine.request import Request


class StopChecker:
    def __init__(self, tokenizer: Any, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def update(self, req: Request) -> tuple[str, str | None]:
        """Account for the request's newest token; return (text to emit now, finish reason or None)."""
        p = req.params
        tok = req.output_ids[-1]
        reason: str | None = None
        ids = req.output_ids
        if (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids:
            reason = "stop"
            ids = ids[:-1]
        text = self._decode(ids)
        if p.stop:
            hits = [(text.find(s), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                text = text[: min(hits)[0]]
                reason = "stop"
        if reason is None and len(req.output_ids) >= p.max_tokens:
            reason = "length"
        visible = text
        if reason is None:
            if visible.endswith("\ufffd"):
                visible = visible.rstrip("\ufffd")
            for s in p.stop:  # hold back a tail that may become a stop string
                for k in range(min(len(s) - 1, len(visible)), 0, -1):
                    if visible.endswith(s[:k]):
                        visible = visible[:-k]
                        break
        if not visible.startswith(req.text):  # detokeniser revised earlier text: emit nothing new
            return "", reason
        new = visible[len(req.text):]
        req.text = visible
        return new, reason
