"""Typed errors for CacheBlend, rooted in the engine's error hierarchy."""

from __future__ import annotations

from engine.errors import EngineError, InvalidRequestError


class BlendError(EngineError):
    """Root of every error CacheBlend raises on purpose."""


class BlendUnsupportedError(BlendError):
    """The start-up self-check failed: this model's RoPE cannot be re-rotated exactly.

    Blending is refused for the whole engine (never silently skipped per request)."""


class InvalidBlendRequestError(BlendError, InvalidRequestError):
    """A request's blend spec is malformed (maps to HTTP 400 like any invalid request)."""
