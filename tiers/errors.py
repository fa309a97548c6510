"""Typed errors for the storage side (tiers and the kvstore daemon): one root, TierKVError."""

from __future__ import annotations


class TierKVError(Exception):
    """Root of every error raised by tiers/ and kvstore/."""


class TierError(TierKVError):
    """A tier failed to do what was asked (server down, I/O error, ...)."""

    def __init__(self, tier: str, message: str) -> None:
        super().__init__(f"[{tier}] {message}")
        self.tier = tier


class TierUnavailable(TierError):
    """The tier's backing server or device cannot be reached."""


class TierFull(TierError):
    """The tier has no room for this block now (lmdb map or filesystem full): a refusal the store
    answers by evicting, not a failure that detaches the tier."""


class TierAuthError(TierError):
    """The tier's server refused our credentials (wrong password, key or signature)."""


class BlockTooLarge(TierKVError):
    """A single block is larger than the tier (or the message limit) can ever hold."""


class StoredValueTooLarge(TierKVError):
    """A value in a tier is larger than the reader accepts (the daemon's largest block): refused
    before its bytes were read (a shared tier's value may come from anyone who can write there)."""


class ConfigError(TierKVError):
    """Invalid configuration (bad size string, unknown tier, missing bucket...)."""
