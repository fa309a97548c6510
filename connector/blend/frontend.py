"""What the server needs of CacheBlend: request pieces in, (prompt ids, the request's blend state) out."""

from __future__ import annotations

from connector.blend.hook import BlendHook
from connector.blend.spec import build_blend_request, build_chat_blend_request, split_by_separator
from connector.blend.state import BlendState


class BlendFrontend:
    def __init__(self, tokenizer, hook: BlendHook) -> None:
        self.tok = tokenizer
        self.hook = hook

    def chat(self, messages: list[dict], documents: list[str], ratio: float | None) -> tuple[list[int], BlendState]:
        ids, spec = build_chat_blend_request(self.tok, messages, documents, ratio)
        return ids, BlendState(spec)

    def plain(self, prompt: str, separator: str, ratio: float | None) -> tuple[list[int], BlendState]:
        system, docs, question = split_by_separator(prompt, separator)
        ids, spec = build_blend_request(self.tok, system, docs, question, ratio)
        return ids, BlendState(spec)
