"""Request bodies to prompt ids: what costs nothing is checked at once, the rest runs off the event loop.

``PromptBuilder.completion`` / ``chat`` check a body's sizes on the caller's thread (a text prompt's
characters, a token prompt's length: engine/limits.py) and return a ``Build``: a function that
tokenises the prompt (rendering the chat template, or building a CacheBlend request through the
``documents`` plug-in) for the server to run on its thread pool. Tokenising costs ~1 s per MiB of
text; on the event loop it would stall /health and every other client meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from engine import limits
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.hooks import DocumentPrompts
from engine.protocol import ChatRequest, CompletionRequest
from engine.request import HookState

Built = tuple[list[int], Mapping[str, HookState] | None]  # prompt ids, the request's plug-in state
Build = Callable[[], Built]


class PromptBuilder:
    def __init__(self, tokenizer: Any, cfg: EngineConfig, context: int, model_name: str,
                 documents: DocumentPrompts | None) -> None:
        self.tok, self.cfg, self.context, self.model_name = tokenizer, cfg, context, model_name
        self.documents = documents  # the plug-in serving `documents` / `blend_separator` (None: refused)

    def completion(self, body: CompletionRequest) -> Build:
        prompt = body.prompt_input()
        docs = self.documents
        if body.blend_separator is not None:
            if docs is None:
                raise InvalidRequestError("CacheBlend is not available on this server", "blend_separator")
            if not isinstance(prompt, str):
                raise InvalidRequestError("blend_separator needs a text prompt", "prompt")
            sep, ratio = body.blend_separator, body.blend_ratio
            limits.check_prompt_chars(self.cfg, self.context, len(prompt), "prompt")
            return lambda: docs.plain(prompt, sep, ratio)
        if isinstance(prompt, list):
            limits.check_prompt_tokens(self.context, len(prompt))
            return lambda: (list(prompt), None)
        limits.check_prompt_chars(self.cfg, self.context, len(prompt), "prompt")
        return lambda: (self._encode(prompt, "prompt"), None)

    def chat(self, body: ChatRequest) -> Build:
        msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in body.messages]
        if not msgs:
            raise InvalidRequestError("messages must not be empty", "messages")
        if not getattr(self.tok, "chat_template", None):  # else transformers raises ValueError: a 500
            raise InvalidRequestError(f"model {self.model_name!r} has no chat template: use /v1/completions",
                                      "messages")
        docs, documents, ratio = self.documents, body.documents, body.blend_ratio
        if documents and docs is None:
            raise InvalidRequestError("CacheBlend is not available on this server", "documents")
        chars = sum(len(m["content"]) for m in msgs) + sum(len(d) for d in documents or ())
        limits.check_prompt_chars(self.cfg, self.context, chars, "messages")
        if documents and docs is not None:
            return lambda: docs.chat(msgs, documents, ratio)

        def build() -> Built:
            text = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            return self._encode(text, "messages", add_special_tokens=False), None
        return build

    def _encode(self, text: str, param: str, **kw: Any) -> list[int]:
        try:
            return self.tok(text, **kw)["input_ids"]
        except UnicodeEncodeError:  # a lone surrogate (from a JSON escape): the tokenizer takes real text only
            raise InvalidRequestError("the prompt must be valid Unicode text (no lone surrogates)", param) from None
