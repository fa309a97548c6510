"""A slow network link in user space: a TCP proxy that rate-limits and delays, on loopback or in a
network namespace.

    with SlowLink(("127.0.0.1", 50051), rate_bytes_per_s=50e6, delay_s=0.0) as link:
        client = KVStoreClient(link.address, use_shm=False)

Why a proxy: this kernel has ``tbf`` but no ``netem``, and a bench must not need root or network
namespaces to put a tier behind a slow path. Every byte a client sends or receives crosses the
proxy, so anything measured through it (a start-up probe, a real load) sees the link; nothing in
the process under test is told its speed. The one proxy for both jobs: a rate-limited path on
loopback (bench/e2e/boundary.py) and a round-trip time on a cluster's link (bench/cluster/).

- Rate: one token bucket per direction of each connection (a link is full duplex), refilled at
  ``rate_bytes_per_s`` (0: unlimited) with a burst of ``burst_bytes``; data is forwarded in chunks
  of at most ``chunk_bytes`` and each waits for its tokens. ``set_rate`` changes it for every
  connection at once (the next chunk sees it).
- Delay: ``delay_s`` one way, added to every chunk in both directions (a round trip costs 2x),
  without holding back the chunks behind it (each is written at its arrival time + delay, in
  order), so a stream keeps its throughput. At most ``window`` chunks wait per direction: a fast
  sender meets back-pressure instead of being buffered whole.
- ``netns``: the proxy's thread runs inside that network namespace (bench/cluster/netns.py), so it
  listens and connects there (a node's side of a slow link); needs root.
- The proxy runs an asyncio loop in a daemon thread of its own, started by ``start()`` or the
  ``with`` block; ``close`` stops it and closes every connection. ``address`` is ``host:port``
  (``sockaddr`` the tuple); ``bytes_forwarded`` counts what crossed, both directions; EOF passes on
  after the data, the other direction staying open; a target that refuses closes the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

_CHUNK = 64 * 1024


class _Bucket:
    def __init__(self, link: SlowLink) -> None:
        self.link = link
        self.tokens = float(link.burst_bytes)
        self.t = time.monotonic()

    def wait_s(self, n: int) -> float:
        """Take ``n`` bytes' tokens; the seconds to wait before sending them (0 when unlimited)."""
        rate = self.link.rate_bytes_per_s
        if rate <= 0:
            return 0.0
        now = time.monotonic()
        self.tokens = min(float(self.link.burst_bytes), self.tokens + (now - self.t) * rate)
        self.t = now
        self.tokens -= n
        return max(0.0, -self.tokens / rate)


class SlowLink:
    def __init__(self, target: tuple[str, int] | str, rate_bytes_per_s: float = 0.0, delay_s: float = 0.0,
                 burst_bytes: int = 256 * 1024, chunk_bytes: int = _CHUNK, host: str = "127.0.0.1", *,
                 netns: str | None = None, window: int = 256) -> None:
        if isinstance(target, str):
            h, _, p = target.rpartition(":")
            target = (h, int(p))
        if rate_bytes_per_s < 0 or delay_s < 0 or burst_bytes <= 0 or chunk_bytes <= 0 or window < 1:
            raise ValueError("SlowLink: rate and delay must be >= 0, burst, chunk and window > 0")
        self.target, self.host, self.netns = (target[0], int(target[1])), host, netns
        self.rate_bytes_per_s, self.delay_s = float(rate_bytes_per_s), float(delay_s)
        self.burst_bytes, self.chunk_bytes = burst_bytes, min(chunk_bytes, burst_bytes)
        self.window = window
        self.bytes_forwarded = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"slow-link-{target[0]}:{target[1]}", daemon=True)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def sockaddr(self) -> tuple[str, int]:
        return self.host, self.port

    def set_rate(self, rate_bytes_per_s: float) -> None:
        self.rate_bytes_per_s = float(rate_bytes_per_s)

    def set_delay(self, delay_s: float) -> None:
        self.delay_s = float(delay_s)

    def start(self) -> SlowLink:
        self._thread.start()
        if not self._ready.wait(10) or self._error is not None or not self.port:
            self.close()
            raise RuntimeError(f"the slow link's proxy to {self.target} did not start: {self._error}")
        return self

    def __enter__(self) -> SlowLink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop already closed
                self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    # -- the loop's side ---------------------------------------------------------------------------
    def _run(self) -> None:
        if self.netns:
            from bench.cluster import netns  # only here: a loopback link needs no namespace tooling

            entered: contextlib.AbstractContextManager[Any] = netns.entered(self.netns)
        else:
            entered = contextlib.nullcontext()
        try:
            with entered:
                asyncio.set_event_loop(self._loop)
                self._server = self._loop.run_until_complete(
                    asyncio.start_server(self._accept, self.host, 0, limit=self.chunk_bytes))
                self.port = self._server.sockets[0].getsockname()[1]
                self._ready.set()
                self._loop.run_forever()
                self._loop.run_until_complete(self._shutdown())
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._error = e
        finally:
            self._ready.set()
            self._loop.close()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        up_w: asyncio.StreamWriter | None = None
        try:
            up_r, up_w = await asyncio.open_connection(*self.target, limit=self.chunk_bytes)
            await asyncio.gather(self._pump(reader, up_w), self._pump(up_r, writer), return_exceptions=True)
        except (ConnectionError, OSError):
            pass  # the target refused, or a side went away: both sides close
        except asyncio.CancelledError:
            pass  # the link is closing: end quietly (a cancelled task here is logged as an error on 3.11)
        finally:
            for w in (writer, up_w):
                if w is not None:
                    _close(w.close)
            self._tasks.discard(task)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """Forward src to dst: each chunk waits for its tokens, then is written ``delay_s`` after it
        arrived (in order: a later chunk is never written before an earlier one)."""
        bucket = _Bucket(self)
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(self.window)
        writer = asyncio.ensure_future(self._deliver(queue, dst))
        try:
            while data := await src.read(self.chunk_bytes):
                arrived = time.monotonic()
                if (w := bucket.wait_s(len(data))) > 0:
                    await asyncio.sleep(w)
                await queue.put((arrived + self.delay_s, data))
        except (ConnectionError, OSError):
            pass
        except asyncio.CancelledError:  # the link is closing: nothing more is delivered
            writer.cancel()
            raise
        await queue.put(None)  # after the data: the writer passes the end on once it wrote them
        await writer

    async def _deliver(self, queue: asyncio.Queue[tuple[float, bytes] | None], dst: asyncio.StreamWriter) -> None:
        try:
            while (item := await queue.get()) is not None:
                due, data = item
                if (w := due - time.monotonic()) > 0:
                    await asyncio.sleep(w)
                self.bytes_forwarded += len(data)  # before the write: a reader that got them sees them counted
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            _close(dst.close)  # the peer is gone: so is this side; what still arrives is dropped,
            while await queue.get() is not None:  # so the reader never blocks on a full queue
                pass
        else:
            _close(dst.write_eof)  # the source ended: pass its end on, keep the other direction


def _close(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except (ConnectionError, OSError, RuntimeError):
        pass
