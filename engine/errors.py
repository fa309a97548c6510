"""Typed errors for the engine: one root, EngineError."""

from __future__ import annotations


class EngineError(Exception):
    """Root of every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """The model could not be found or its architecture is not supported."""


class InvalidRequestError(EngineError):
    """A request is malformed (bad sampling params, empty prompt, ...). Maps to HTTP 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus max_tokens) can never fit in the KV pool or the model's context."""


class OverloadedError(EngineError):
    """The engine has as many requests in flight as it takes (running + waiting). Maps to HTTP 429."""


class EngineDeadError(EngineError):
    """The engine loop stopped after an unexpected error."""


class ConfigError(EngineError, ValueError):
    """A configuration value (flag, environment variable) is invalid."""
