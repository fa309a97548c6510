"""Typed errors of the kvstore daemon and its client.

Every error derives from ``tiers.errors.TierKVError`` (the one root of the storage side), so a
caller can catch the whole family with one ``except`` and still tell the cases apart.
"""

from __future__ import annotations

from tiers.errors import TierKVError


class KVStoreError(TierKVError):
    """Root of errors raised by kvstore/ itself (not by a tier)."""


class BlockFormatError(KVStoreError):
    """A block's bytes are not a valid encoded block (bad magic/version, truncated, inconsistent)."""


class ChecksumError(BlockFormatError):
    """A block's checksum does not match its bytes: it was corrupted in transit or at rest."""


class InvalidRequest(KVStoreError):
    """The daemon refused a request as malformed (maps to gRPC INVALID_ARGUMENT)."""


class ResourceExhausted(KVStoreError):
    """A request exceeds a size limit of the daemon (maps to gRPC RESOURCE_EXHAUSTED)."""


class KVStoreUnavailable(KVStoreError):
    """The daemon cannot be reached (down, wrong address, connection lost). Retryable."""


class KVStoreTimeout(KVStoreError):
    """The daemon did not answer within the call's deadline. Retryable."""


class ShmSessionLost(KVStoreError):
    """The daemon no longer holds this shared-memory session (evicted, reclaimed or restarted):
    attach a fresh segment and retry (maps to gRPC FAILED_PRECONDITION)."""


class StoreClosed(KVStoreError):
    """The TieredStore was closed and accepts no more calls."""


class PermissionDenied(KVStoreError):
    """The daemon refused a key (or an operator call) to this call's credential: another tenant's
    namespace, a write to the shared one without admin (maps to gRPC PERMISSION_DENIED). Not retried."""
