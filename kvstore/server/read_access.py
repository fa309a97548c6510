"""Who may read which block: the one question the daemon's shared-memory paths ask.

Shared memory is where one client could see more than it asked for: the cpu tier's arena holds
every tenant's blocks, each with its key in its header. So the servicer asks a ``ReadAccess``:

- ``caller(context)``: who is calling (derived from the call's credential, never from the
  request). Sessions and their leases belong to the caller that attached them.
- ``sees_all(caller)``: may this caller read every block? Only such a caller is handed the
  arena's read-only fd and answered in place (zero-copy); any other caller's Gets are copied
  into its own segment, block by block.
- ``may_read(caller, key)``: may this caller read block ``key``? Asked for every block of a
  shared-memory Get; a block it may not read is answered as a miss.

``ALLOW_ALL`` is today's daemon: one credential, every caller reads every block, the arena is
shared (the zero-copy path). A daemon with per-tenant credentials plugs in its own ReadAccess
(``KVStoreServicer(access=...)``). ``--no-shm-arena`` is the switch that keeps the arena private
whatever the access says.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Protocol

import grpc


class ReadAccess(Protocol):
    def caller(self, context: grpc.ServicerContext) -> Hashable:
        """Who is calling: compared by equality, kept with the sessions it attaches."""

    def sees_all(self, caller: Hashable) -> bool:
        """Whether ``caller`` may read every block (and so may map the cpu arena)."""

    def may_read(self, caller: Hashable, key: bytes) -> bool:
        """Whether ``caller`` may read the block ``key``."""


class AllowAll:
    """One credential: every caller may read every block."""

    def caller(self, context: grpc.ServicerContext) -> Hashable:
        return None

    def sees_all(self, caller: Hashable) -> bool:
        return True

    def may_read(self, caller: Hashable, key: bytes) -> bool:
        return True


ALLOW_ALL = AllowAll()
