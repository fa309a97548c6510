"""A userspace TCP proxy that adds a fixed one-way delay to every chunk, both ways (RTT = 2 x delay).

Why userspace: this kernel has no ``netem``, and ``tbf`` shapes rate, not latency. A client talks
to ``proxy.address`` instead of the server; each chunk read from one side is written to the other
``delay_s`` after it was read, in order, so a request/response pays ``2 * delay_s`` more and a
stream keeps its throughput (chunks in flight overlap). A bounded queue per direction (``window``
chunks) gives back-pressure instead of buffering a fast sender's whole stream.

``DelayProxy(target, delay_s)`` runs its own event loop in a thread (for synchronous tests and
benches); ``netns``: that thread runs inside a network namespace (bench/cluster/netns.py), so the
proxy listens and connects there (the node's side of a slow link). Leaving the ``with`` block
closes the listener and every connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator

from bench.cluster import netns as _netns

CHUNK = 64 << 10


class DelayProxy:
    def __init__(self, target: tuple[str, int], delay_s: float, *, listen: tuple[str, int] = ("127.0.0.1", 0),
                 netns: str | None = None, window: int = 256) -> None:
        if delay_s < 0 or window < 1:
            raise ValueError(f"delay_s must be >= 0 and window >= 1, got {delay_s}, {window}")
        self.target, self.delay_s, self.window = target, delay_s, window
        self._listen, self._netns = listen, netns
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.address: tuple[str, int] = ("", 0)
        self._thread = threading.Thread(target=self._run, name=f"delay-proxy-{target[0]}:{target[1]}", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None or not self._ready.is_set():
            self.close()
            raise RuntimeError(f"delay proxy to {target} did not start: {self._error}")

    def _run(self) -> None:
        with _netns.entered(self._netns) if self._netns else contextlib.nullcontext():
            asyncio.set_event_loop(self._loop)
            try:
                self._server = self._loop.run_until_complete(
                    asyncio.start_server(self._accept, *self._listen, limit=CHUNK))
                self.address = self._server.sockets[0].getsockname()[:2]
            except BaseException as e:  # noqa: BLE001 - reported by the constructor
                self._error = e
                self._ready.set()
                return
            self._ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._shutdown())
            self._loop.close()

    async def _accept(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            s_reader, s_writer = await asyncio.open_connection(*self.target, limit=CHUNK)
        except OSError:
            c_writer.close()
            self._tasks.discard(task)
            return
        try:
            await asyncio.gather(self._pipe(c_reader, s_writer), self._pipe(s_reader, c_writer))
        finally:
            for w in (c_writer, s_writer):
                w.close()
            self._tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copy one direction: each chunk leaves ``delay_s`` after it arrived; EOF passes on after them."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(self.window)

        async def read() -> None:
            try:
                while data := await reader.read(CHUNK):
                    await queue.put((time.monotonic() + self.delay_s, data))
            except (ConnectionError, OSError):
                pass
            await queue.put((time.monotonic() + self.delay_s, b""))

        async def write() -> None:
            while True:
                due, data = await queue.get()
                if (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                if not data:
                    with contextlib.suppress(OSError):
                        if writer.can_write_eof():
                            writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()

        reading = asyncio.ensure_future(read())
        try:
            await write()
        except (ConnectionError, OSError):
            pass
        finally:
            reading.cancel()

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def close(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> DelayProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def delayed(target: tuple[str, int], delay_s: float, **kw: object) -> Iterator[tuple[str, int]]:
    """The address of a DelayProxy to ``target`` for a ``with`` block."""
    with DelayProxy(target, delay_s, **kw) as proxy:  # type: ignore[arg-type]
        yield proxy.address
