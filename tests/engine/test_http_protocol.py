"""engine/http_protocol.py: the engine serving its own API (no gate) answers a declared body past its
bound in uvicorn's protocol, before any ASGI work; engine/gate.py ``listening_socket``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from engine.gate import listening_socket
from engine.http_protocol import refusing_protocol

MAX_BODY = 1000


class Counting:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.calls += 1
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def served() -> Iterator[tuple[Counting, int]]:
    app = Counting()
    sock = listening_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, http=refusing_protocol(MAX_BODY), loop="asyncio", lifespan="off",
                                           log_level="warning"))  # fmt: skip
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_until_complete, args=(server.serve(sockets=[sock]),), daemon=True)
    t.start()
    while not server.started:
        t.join(0.01)
    try:
        yield app, sock.getsockname()[1]
    finally:
        server.should_exit = True
        t.join(10)
        sock.close()


def test_a_declared_body_past_the_bound_never_reaches_the_app(served: tuple[Counting, int]) -> None:
    app, port = served
    base = f"http://127.0.0.1:{port}"
    r = httpx.post(base + "/v1/completions", content=b"x" * (MAX_BODY + 1))
    assert r.status_code == 413 and r.headers["connection"] == "close"
    assert r.json()["error"]["message"] == (f"Content Too Large: at most {MAX_BODY} bytes of body are accepted, "
                                            f"the body has {MAX_BODY + 1} bytes")
    assert app.calls == 0
    with httpx.Client(base_url=base) as c:  # within the bound, and keep-alive after it, as before
        assert [c.post("/x", content=b"y" * MAX_BODY).status_code for _ in range(3)] == [200] * 3
    assert app.calls == 3


def test_a_taken_address_is_an_oserror() -> None:
    with listening_socket("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        with pytest.raises(OSError):
            listening_socket("127.0.0.1", port).close()
