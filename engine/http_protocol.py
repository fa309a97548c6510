"""The engine's HTTP protocol when it serves its API itself (no gate, engine/gate.py): uvicorn's
httptools protocol, answering a body whose Content-Length is past the engine's bound with its 413
from ``on_headers_complete``, before uvicorn builds the request's ASGI scope, cycle and task, and
before any middleware; the connection is closed, the rest of the body unread. The ASGI middleware
(engine/server.py ``_CloseUnread``) still answers chunked bodies, and on the pure-Python stack.

Why: the HTTP side shares one interpreter with the step loop (engine/cli.py ``http_stack``); on a
machine without cores to spare for the gate, every microsecond of a refusal is taken from decoding.
Measured with bench.http_stack's in-process stack, 2 reps each, alternated: the engine's CPU per
refused 16 MB body 295-368 us, against 533-581 us through the ASGI middleware. The stream's ITL
under that flood did not change measurably (p99 ratios 1.18-1.55 against 1.31-1.35: within the
windows' noise). A bounded SO_RCVBUF (256 KiB) on the listening socket was tried too: 475-536 us, and
no better ITL; left out.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from engine.gate import too_large_answer
from engine.limits import declared_past


def refusing_protocol(max_body: int) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol, answering a declared body past ``max_body`` with a 413 itself."""

    class RefusingHttpTools(HttpToolsProtocol):
        _refused = False

        def data_received(self, data: bytes) -> None:
            if not self._refused:
                super().data_received(data)

        def on_headers_complete(self) -> None:
            declared = next((value for name, value in self.headers if name == b"content-length"), None)  # lower-cased
            if (size := declared_past(declared, max_body)) is not None:
                self._refused = True
                self.transport.write(too_large_answer(max_body, size))
                self.transport.close()
                return
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if not self._refused:
                super().on_message_complete()

    return RefusingHttpTools
