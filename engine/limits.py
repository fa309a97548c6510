"""Bounds on what one API client can ask of the engine, each with a one-line error naming its parameter.

Every input a client controls has a bound, so no single request can cost the others
(docs/operations.md, "Limits of the engine's API"): how many stop strings and how long (the stop
checker's work per token grows with them), how many stop token ids, how long a ``cache_salt`` is,
how many characters a text prompt has before it is tokenised (tokenising costs ~1 s per MiB), and
how many requests are in flight at once (``InFlight``: past ``max_num_seqs + max_waiting`` a
request is answered 429 at once instead of joining an unbounded queue), and how many of them one
tenant holds (``max_tenant_in_flight``: a tenant that floods is refused 429 itself while the others
still get in, instead of filling every place and locking them out). The prompt's length in
tokens is bounded by the context (engine/scheduler.py ``check_fits``), and so is ``max_tokens``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence

from engine.config import EngineConfig
from engine.errors import InvalidRequestError, OverloadedError, PromptTooLongError

#: ``max_prompt_chars`` = 0: this many characters per token of context (no real text comes near it:
#: English runs ~4-5 characters a token)
PROMPT_CHARS_PER_TOKEN = 16
#: ``max_body_bytes`` = 0: this many bytes per token of context (16 characters a token, each up to a
#: 6-byte JSON escape, with room for CacheBlend's document lists), and never less than MIN_BODY_BYTES.
#: A body past it is refused 413 from its Content-Length, before a byte is read (or as soon as a
#: chunked one passes it): reading and parsing a body holds the event loop, so a body the context
#: could never use must not be read at all (bench.soak measured 16 MB bodies of stop strings
#: or prompt text raising a streaming client's ITL p99 5x while each was refused after parsing).
BODY_BYTES_PER_TOKEN = 128
MIN_BODY_BYTES = 1 << 20
MAX_BODY_BYTES = 16 << 20  # the derived bound's ceiling (a 128k-token context); max_body_bytes may set more
#: a request of a tenant at its share waits this long at the door for a place its tenant gives back
DOOR_WAIT_S = 30.0


def check_stop(cfg: EngineConfig, stop: Sequence[str], stop_token_ids: Sequence[int]) -> None:
    if len(stop) > cfg.max_stop_strings:
        raise InvalidRequestError(f"at most {cfg.max_stop_strings} stop strings are allowed, got {len(stop)}", "stop")
    longest = max((len(s) for s in stop), default=0)
    if longest > cfg.max_stop_chars:
        raise InvalidRequestError(f"a stop string may have at most {cfg.max_stop_chars} characters, got one of "
                                  f"{longest}", "stop")
    if len(stop_token_ids) > cfg.max_stop_token_ids:
        raise InvalidRequestError(f"at most {cfg.max_stop_token_ids} stop_token_ids are allowed, got "
                                  f"{len(stop_token_ids)}", "stop_token_ids")


def check_salt(cfg: EngineConfig, salt: str | None) -> None:
    """Bounded, and text that encodes (a lone surrogate from a JSON escape would raise where the
    connector hashes the salt, on the step thread)."""
    if not salt:
        return
    too_long = InvalidRequestError(f"cache_salt may have at most {cfg.max_salt_bytes} bytes (UTF-8)", "cache_salt")
    if len(salt) > cfg.max_salt_bytes:  # a character is at least a byte: no need to encode it
        raise too_long
    try:
        n = len(salt.encode("utf-8"))
    except UnicodeEncodeError:
        raise InvalidRequestError("cache_salt must be valid Unicode text (no lone surrogates)", "cache_salt") from None
    if n > cfg.max_salt_bytes:
        raise too_long


def too_large(max_body: int, size: int | None = None) -> str:
    """The one message of a 413, whether the body declared its length or was cut off reading it (the
    engine's server and its gate, engine/gate.py, say the same)."""
    has = f"has {size} bytes" if size is not None else "is longer than that (chunked)"
    return f"Content Too Large: at most {max_body} bytes of body are accepted, the body {has}"


def declared_past(declared: bytes | None, max_body: int) -> int | None:
    """The size a request's Content-Length header value declares, when it is past ``max_body`` (the
    body is then refused 413 before a byte of it is read); None otherwise. One rule for the engine's
    ASGI middleware, its httptools protocol and its gate."""
    if declared is not None and (declared := declared.strip()).isdigit() and (size := int(declared)) > max_body:
        return size
    return None


def body_bytes_limit(cfg: EngineConfig, max_model_len: int) -> int:
    return cfg.max_body_bytes or min(MAX_BODY_BYTES, max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len))


def prompt_chars_limit(cfg: EngineConfig, max_model_len: int) -> int:
    return cfg.max_prompt_chars or PROMPT_CHARS_PER_TOKEN * max_model_len


def check_prompt_chars(cfg: EngineConfig, max_model_len: int, chars: int, param: str) -> None:
    """Before tokenising: a text longer than this cannot fit the context anyway."""
    limit = prompt_chars_limit(cfg, max_model_len)
    if chars > limit:
        raise PromptTooLongError(f"the prompt has {chars} characters; at most {limit} are accepted "
                                 f"(context: {max_model_len} tokens)", param)


def check_prompt_tokens(max_model_len: int, n: int) -> None:
    """Before looking at the ids one by one: more than the context can never fit."""
    if n > max_model_len:
        raise PromptTooLongError(f"the prompt has {n} tokens, more than the model's context length "
                                 f"{max_model_len}", "prompt")


def tenant_in_flight(cfg: EngineConfig, several_tenants: bool) -> int:
    """What one tenant may hold of the ``max_num_seqs + max_waiting`` places (``max_tenant_in_flight``;
    0: half of them when API keys bring several tenants, all of them for an engine's one tenant)."""
    capacity = cfg.max_num_seqs + cfg.max_waiting
    if cfg.max_tenant_in_flight:
        return min(cfg.max_tenant_in_flight, capacity)
    return max(1, capacity // 2) if several_tenants else capacity


class Slot:
    """One request's place among those in flight; ``release`` is idempotent."""

    __slots__ = ("_owner", "_tenant")

    def __init__(self, owner: InFlight, tenant: str) -> None:
        self._owner: InFlight | None = owner
        self._tenant = tenant

    def release(self) -> None:
        if self._owner is not None:
            self._owner._leave(self._tenant)
            self._owner = None


class InFlight:
    """API requests accepted and not yet finished (tokenising, queued, loading or running), at most
    ``capacity``, and at most ``per_tenant`` of one tenant; ``on_change(count)`` after each change (a
    gauge). Used from the event loop only."""

    def __init__(self, capacity: int, on_change: Callable[[int], object] = lambda _: None,
                 per_tenant: int | None = None) -> None:  # fmt: skip
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        if per_tenant is not None and per_tenant <= 0:
            raise ValueError(f"per_tenant must be > 0, got {per_tenant}")
        self.capacity = capacity
        self.per_tenant = capacity if per_tenant is None else min(per_tenant, capacity)
        self.count = 0
        self.by_tenant: dict[str, int] = {}  # only tenants with a request in flight: bounded by capacity
        self.on_change = on_change
        #: tenant -> requests waiting for one of its places (``admit``), oldest first; ``capacity`` in all
        self.door: dict[str, deque[asyncio.Future[Slot]]] = {}
        self.at_door = 0

    def _full(self) -> OverloadedError:
        return OverloadedError(f"the server has {self.count} requests in flight, as many as it takes; retry later")

    def _share(self, tenant: str) -> OverloadedError:
        return OverloadedError(f"this API key's tenant has {self.by_tenant.get(tenant, 0)} requests in flight, "
                               "its share of the server; retry later")

    def enter(self, tenant: str = "") -> Slot:
        if self.count >= self.capacity:
            raise self._full()
        held = self.by_tenant.get(tenant, 0)
        if held >= self.per_tenant:
            raise self._share(tenant)
        self.by_tenant[tenant] = held + 1
        self.count += 1
        self.on_change(self.count)
        return Slot(self, tenant)

    async def admit(self, tenant: str = "", wait_s: float = DOOR_WAIT_S) -> Slot:
        """``enter``, except that a request of a tenant at its share waits at the door (oldest first,
        its body unread, no work done for it) up to ``wait_s`` for a place its tenant gives back,
        instead of a 429 at once. Why: a client that ignores Retry-After asks again at once, and the
        server then answers 429s in a loop on the interpreter its step loop shares (a 32-wide flood
        held to a share of 2 drew 1,100 429s a second and quadrupled another client's ITL). Past the
        server's capacity, past the door's room (``capacity`` requests, all tenants together) or past
        ``wait_s``: 429."""
        if self.count >= self.capacity or self.by_tenant.get(tenant, 0) < self.per_tenant:
            return self.enter(tenant)
        if self.at_door >= self.capacity:
            raise self._share(tenant)
        queue = self.door.setdefault(tenant, deque())
        fut: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        queue.append(fut)
        self.at_door += 1
        try:
            await asyncio.wait({fut}, timeout=wait_s)
        except asyncio.CancelledError:
            if fut.done():  # handed a place just as the request went away: give it back
                fut.result().release()
            raise
        finally:
            self.at_door -= 1
            if not fut.done():
                fut.cancel()
                queue.remove(fut)
            if not queue and self.door.get(tenant) is queue:
                del self.door[tenant]
        if fut.cancelled():
            raise self._share(tenant)
        return fut.result()

    def _leave(self, tenant: str) -> None:
        queue = self.door.get(tenant)
        while queue:  # the place goes to the oldest request of the same tenant at the door
            fut = queue.popleft()
            if not fut.done():
                fut.set_result(Slot(self, tenant))
                return
        held = self.by_tenant[tenant] - 1
        if held:
            self.by_tenant[tenant] = held
        else:
            del self.by_tenant[tenant]
        self.count -= 1
        self.on_change(self.count)
