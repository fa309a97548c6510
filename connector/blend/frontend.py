"""What callers need of CacheBlend: request pieces in, (prompt ids, the request's plug-in state) out,
and a blend request queued on an engine."""

from __future__ import annotations

import uuid

from connector.blend.hook import BlendHook
from connector.blend.spec import BlendSpec, build_blend_request, build_chat_blend_request, split_by_separator
from connector.blend.state import BlendState, blend_extras
from engine.request import HookState
from engine.sampling import SamplingParams


class BlendFrontend:
    """The server's ``DocumentPrompts`` (engine/hooks.py) for the hook it was built with."""

    def __init__(self, tokenizer, hook: BlendHook) -> None:
        self.tok = tokenizer
        self.hook = hook

    def chat(self, messages: list[dict], documents: list[str], ratio: float | None) -> tuple[list[int], dict[str, HookState]]:
        ids, spec = build_chat_blend_request(self.tok, messages, documents, ratio)
        return ids, blend_extras(BlendState(spec))

    def plain(self, prompt: str, separator: str, ratio: float | None) -> tuple[list[int], dict[str, HookState]]:
        system, docs, question = split_by_separator(prompt, separator)
        ids, spec = build_blend_request(self.tok, system, docs, question, ratio)
        return ids, blend_extras(BlendState(spec))


def add_blend_request(engine, spec: BlendSpec, params: SamplingParams | None = None, rid: str | None = None,
                      cache_salt: str | None = None) -> str:
    """``engine.add_request`` for a blend spec (prompt = the segments' concatenation), for callers of
    the engine (never a hook: a hook submits through the view it was built with)."""
    return engine.add_request(spec.prompt_ids, params, rid=rid or uuid.uuid4().hex, cache_salt=cache_salt,
                              extras=blend_extras(BlendState(spec)))
