"""OpenAI request bodies (the subset we serve) and their mapping onto SamplingParams.

Unknown fields are accepted and ignored, as OpenAI-compatible servers do; fields we cannot honour
(n > 1, best_of, echo with logprobs) are refused with a 400 instead of silently ignored.
Extensions: ``top_k``, ``ignore_eos``, ``cache_salt`` (tenant isolation of cached KV), CacheBlend's
``documents`` (chat: retrieved documents reused at any position) or ``blend_separator`` (completions:
a plain prompt "system SEP doc SEP ... SEP question"), each with an optional ``blend_ratio``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.errors import InvalidRequestError
from engine.sampling import SamplingParams


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(default=None)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False
    cache_salt: str | None = None
    user: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def sampling(self, default_max: int) -> SamplingParams:
        if self.n != 1:
            raise InvalidRequestError("only n=1 is supported", "n")
        stop = self.stop_strings()
        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            stop=stop, stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None
    blend_separator: str | None = None  # "system SEP doc SEP ... SEP question" -> CacheBlend
    blend_ratio: float | None = None

    def prompt_input(self) -> str | list[int]:
        p = self.prompt
        if self.echo:
            raise InvalidRequestError("echo is not supported", "echo")
        if self.best_of not in (None, 1):
            raise InvalidRequestError("best_of is not supported", "best_of")
        if self.logprobs:
            raise InvalidRequestError("logprobs is not supported", "logprobs")
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise InvalidRequestError("batched prompts are not supported; send one prompt per request", "prompt")
            p = p[0]
        if isinstance(p, str) and not p:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if isinstance(p, list) and not p:
            raise InvalidRequestError("the prompt is empty", "prompt")
        return p  # type: ignore[return-value]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise InvalidRequestError(f"content part type {part.get('type')!r} is not supported", "messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    documents: list[str] | None = None
    blend_ratio: float | None = None

    def sampling(self, default_max: int) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling(default_max)
