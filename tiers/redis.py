"""Redis tier: a shared remote tier on a standalone Redis or a Redis Cluster.

Why these choices:
- Keys are ``prefix + key`` (binary-safe), so several stores can share one server and ``scan``
  finds exactly our blocks with one escaped MATCH pattern.
- ``contains_many`` (the store's lookup) is one non-transactional pipeline: one round trip on a
  single server; redis-py's cluster pipeline splits per node, so the same code works on both.
- Short socket timeouts and a single reconnect attempt without backoff: a dead or hung server
  becomes TierUnavailable in about ``socket_timeout_s``, never a hang. So does a cluster failing
  over (CLUSTERDOWN, MASTERDOWN, TRYAGAIN): transient, the breaker retries it.
- A cluster that cannot be reached (the node's link cut) too: redis-py answers a connection error
  by refreshing its topology, asking every known node in turn, each up to the connect timeout
  (measured: 6-11 s for one call). So the cluster client retries no command itself (a failed
  command asks for a refresh that the *next* call runs), and a ``ReachGate`` (tiers/reach.py) sits
  in front of every call: after an unreachable error the next call first checks with one bounded
  connect to every known node at once (at most ``connect_timeout_s``; ms when any answers), and
  while nothing answers calls are refused at once, checked again every ``retry_after_s``. Cut
  off, the first call fails in about ``socket_timeout_s``, the others in at most
  ``connect_timeout_s``; a healed link is found within about ``retry_after_s``. A gate rather
  than a deadline on every call: a deadline cannot interrupt redis-py (mid-refresh, that would
  leave its client half updated), only stop waiting for it on a thread of its own, and a bulk
  read's time grows with its size, not with faults. The lookup alone is bounded that way:
  ``contains_many``, a cluster pipeline whose node reads redis-py waits out one after the other
  and then resends one by one (8.2 s measured), answers within ``connect_timeout_s +
  socket_timeout_s`` (tiers/deadline.py). ``connect=False`` builds
  the client without touching the server (the daemon starts while Redis is down; ``probe``
  connects later). A cluster's url may list several startup nodes, comma-separated
  (``redis://:pw@a:6379/0,redis://b:6379/0``; credentials in the first only): a client started
  while the one node it knows is down still finds the cluster. Refused credentials are
  TierAuthError ("authentication failed"), not "cannot reach".
- Budget: a Redis shared by several nodes enforces its own (``maxmemory`` + an eviction policy
  such as ``allkeys-lru``, and/or ``ttl_s``); a server with neither is logged at start, since it
  would grow until it runs out of memory. See kvstore/README.md, "Shared tiers".
- The URL's password never appears in errors, logs or reprs (``redact_url``); ``password`` (read
  from a secret file by the daemon) keeps it out of the URL altogether. ``tls_ca``: the CA file
  that signed a ``rediss://`` server's certificate.
- ``max_value_bytes``: ``get`` asks for at most that many bytes plus one (one GETRANGE instead of
  GET, the same round trip), and a longer value is refused (StoredValueTooLarge) with the rest of
  it never sent: anyone who can write to the server chooses what is stored, and a 512 MiB value
  would otherwise be read whole into the daemon's memory.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import redis
import redis.exceptions as rex
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import parse_url
from redis.retry import Retry

from tiers.base import Buffer, Tier
from tiers.deadline import BoundedCalls
from tiers.errors import BlockTooLarge, StoredValueTooLarge, TierAuthError, TierError, TierUnavailable
from tiers.reach import ReachGate
from tiers.redact import redact_url

log = logging.getLogger(__name__)
_UNREACHABLE = (rex.ConnectionError, rex.TimeoutError, rex.RedisClusterException, OSError)
# A cluster's answers while it fails over or moves slots: transient, the server is there but cannot
# serve this key now (CLUSTERDOWN, MASTERDOWN - a ClusterDownError - and TRYAGAIN). They derive from
# ResponseError, so they are caught before it.
_FAILING_OVER = (rex.ClusterDownError, rex.TryAgainError)


def _glob_escape(raw: bytes) -> bytes:
    out = bytearray()
    for b in raw:
        if b in b"*?[]\\":
            out += b"\\"
        out.append(b)
    return bytes(out)


class RedisTier(Tier):
    name = "redis"
    persistent = True  # the server keeps the blocks when the owning process restarts

    def __init__(
        self,
        url: str,
        capacity_bytes: int,
        *,
        ttl_s: int | None = None,
        cluster: bool = False,
        prefix: bytes = b"tierkv:",
        socket_timeout_s: float = 2.0,
        connect_timeout_s: float = 1.0,
        read_chunk_bytes: int = 1 << 20,
        connect: bool = True,
        password: str | None = None,
        tls_ca: str | None = None,
        max_value_bytes: int | None = None,
        retry_after_s: float = 0.5,
    ) -> None:
        super().__init__(capacity_bytes)
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"redis: ttl_s must be > 0, got {ttl_s}")
        if max_value_bytes is not None and max_value_bytes <= 0:
            raise ValueError(f"redis: max_value_bytes must be > 0, got {max_value_bytes}")
        self.max_value_bytes = max_value_bytes
        self.ttl_s, self.prefix, self.cluster = ttl_s, bytes(prefix), cluster
        urls = url.split(",")
        self.where = ",".join(redact_url(u) for u in urls)
        if len(urls) > 1 and not cluster:
            raise TierError(self.name, f"several urls are startup nodes of a cluster (cluster mode), got {self.where}")
        if any("@" in u for u in urls[1:]):  # one set of credentials: the first url's (or password)
            raise TierError(self.name, f"only the first url may carry credentials, got {self.where}")
        self._pattern = _glob_escape(self.prefix) + b"*"
        opts: dict[str, Any] = dict(
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            # a standalone client reconnects once; a cluster client retries nothing (its retry
            # would run a topology refresh through every node: see the module doc)
            retry=Retry(NoBackoff(), 0 if cluster else 1),
            socket_read_size=read_chunk_bytes,  # MB-sized replies: fewer recv calls than the 64 KiB default
        )
        if password is not None:
            opts["password"] = password
        if tls_ca:
            if not url.startswith("rediss://"):
                raise TierError(self.name, f"tls_ca {tls_ca} needs a rediss:// url, got {self.where}")
            opts["ssl_ca_certs"] = tls_ca
        self._url, self._opts = urls[0], opts
        self._r: Any = None
        self._closed, self._budget_checked = False, False
        self._connecting = threading.Lock()
        self._gate = ReachGate(self._addresses, connect_timeout_s, retry_after_s)
        # a cluster's lookup spans nodes: bounded to one node's connect + read (tiers/deadline.py)
        self._lookups = BoundedCalls(4, "redis-lookup") if cluster else None
        self._lookup_deadline_s = connect_timeout_s + socket_timeout_s
        try:
            # a malformed URL fails here even when the tier connects later
            self._parsed = [parse_url(u) for u in urls]
            self._startup = self._parsed[1:]
            if not cluster:  # builds a pool; connects on the first command
                self._r = redis.Redis.from_url(url, health_check_interval=0, **opts)
        except ValueError as e:  # the parser's message may quote the password
            raise TierError(self.name, f"bad url {self.where} ({type(e).__name__})") from None
        if connect:
            self.probe()

    def __repr__(self) -> str:
        return f"RedisTier({self.where!r}, capacity_bytes={self.capacity_bytes}, prefix={self.prefix!r})"

    def _check_budget(self) -> None:
        """Log when nothing bounds the server: no ``maxmemory`` and no TTL on our keys."""
        if self.ttl_s is not None:
            return
        try:
            cfg = self._r.config_get("maxmemory") if not self.cluster else {}
        except rex.RedisError:  # CONFIG is often disabled on managed servers: nothing to check
            return
        if str(cfg.get("maxmemory", "")) == "0":
            log.warning("redis at %s has no maxmemory and tierkv sets no TTL: shared blocks are never "
                        "evicted; set maxmemory + maxmemory-policy allkeys-lru, or ttl_s", self.where)

    # -- helpers --------------------------------------------------------------
    def _k(self, key: bytes) -> bytes:
        return self.prefix + bytes(key)

    def _client(self) -> Any:
        if self._closed:
            raise TierError(self.name, "tier is closed")
        if self._r is None:  # a cluster client connects when it is built, to discover the nodes
            with self._connecting:
                if self._r is None:
                    self._gate.suspect()  # building asks every startup node in turn: check first
                    more = [ClusterNode(u["host"], u.get("port", 6379)) for u in self._startup]
                    self._r = self._do(self.where, RedisCluster.from_url, self._url, startup_nodes=more, **self._opts)
        return self._r

    def _cmd(self, name: str, *args: Any, **kw: Any) -> Any:
        """Run one client command by name (after the closed check)."""
        return self._do(name, getattr(self._client(), name), *args, **kw)

    def _addresses(self) -> list[tuple[str, int]]:
        """Every (host, port) known: the urls', and a cluster client's current nodes."""
        known = [(u["host"], int(u.get("port", 6379))) for u in self._parsed if u.get("host")]
        if isinstance(self._r, RedisCluster):
            known += [(n.host, int(n.port)) for n in self._r.get_nodes()]
        return list(dict.fromkeys(known))

    def _do(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        """Run one call, mapping redis-py failures onto the tier's error types."""
        if (why := self._gate.refusal()) is not None:
            raise TierUnavailable(self.name, f"{what}: cannot reach the server: {why}")
        try:
            return fn(*args, **kw)
        except rex.AuthenticationError as e:  # before _UNREACHABLE: it derives from ConnectionError
            raise TierAuthError(self.name, f"{what}: authentication failed ({e})") from e
        except _FAILING_OVER as e:
            raise TierUnavailable(self.name, f"{what}: the cluster cannot serve this key now: {e}") from e
        except rex.ResponseError as e:
            if str(e).startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
                raise TierAuthError(self.name, f"{what}: authentication failed ({e})") from e
            raise TierError(self.name, f"{what}: {e}") from e
        except _UNREACHABLE as e:
            self._gate.suspect()
            raise TierUnavailable(self.name, f"{what}: cannot reach the server: {e}") from e
        except rex.RedisError as e:
            raise TierError(self.name, f"{what}: {e}") from e

    def _pipe(self) -> Any:
        return self._client().pipeline(transaction=False)

    @staticmethod
    def _body(value: Buffer) -> bytes | memoryview:
        return value if isinstance(value, bytes) else memoryview(value).cast("B")

    def _check_size(self, n: int) -> None:
        if n > self.capacity_bytes:
            raise BlockTooLarge(f"[redis] block of {n} bytes exceeds capacity {self.capacity_bytes}")

    # -- Tier interface -------------------------------------------------------
    def put(self, key: bytes, value: Buffer) -> None:
        body = self._body(value)
        self._check_size(len(body))
        self._cmd("set", self._k(key), body, ex=self.ttl_s)

    def get(self, key: bytes) -> bytes | None:
        limit = self.max_value_bytes
        if limit is None:
            return self._cmd("get", self._k(key))
        value = self._cmd("getrange", self._k(key), 0, limit)  # at most limit + 1 bytes
        if not value:  # GETRANGE answers "" for a missing key (and no block is empty)
            return None
        if len(value) > limit:
            raise StoredValueTooLarge(f"[redis] value of {key.hex()[:16]} is over {limit} bytes: refused")
        return value

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        pipe = self._pipe()
        for k in keys:
            pipe.exists(self._k(k))
        if not keys:
            return []
        if self._lookups is None:
            return [bool(x) for x in self._do("exists(pipeline)", pipe.execute)]
        return [bool(x) for x in self._do("exists(pipeline)", self._lookups.call, pipe.execute, self._lookup_deadline_s)]

    def delete(self, key: bytes) -> bool:
        return bool(self._cmd("delete", self._k(key)))

    def scan(self) -> Iterator[tuple[bytes, int]]:
        """Keys under our prefix with their sizes (batches of SCAN, then one STRLEN pipeline each)."""
        it = self._cmd("scan_iter", match=self._pattern, count=1000)
        n = len(self.prefix)
        while True:
            batch = self._do("scan", lambda: [k for _, k in zip(range(1000), it, strict=False)])
            if not batch:
                return
            pipe = self._pipe()
            for k in batch:
                pipe.strlen(k)
            for k, size in zip(batch, self._do("strlen(pipeline)", pipe.execute), strict=True):
                if size:  # 0: expired or deleted between SCAN and STRLEN (or an empty block)
                    yield bytes(k[n:]), int(size)
                elif self._cmd("exists", k):
                    yield bytes(k[n:]), 0

    def probe(self) -> None:
        """PING (connecting a cluster client first); the first answer also checks the budget.
        A suspect reach gate checks at once (``eager``): the prober, not a request, waits on it."""
        if (why := self._gate.refusal(eager=True)) is not None:
            raise TierUnavailable(self.name, f"probe: cannot reach the server: {why}")
        self._cmd("ping")
        if not self._budget_checked:
            self._budget_checked = True
            self._check_budget()

    def close(self) -> None:
        self._closed = True
        if self._lookups is not None:
            self._lookups.close()
        if self._r is not None:
            self._r.close()
            self._r = None
