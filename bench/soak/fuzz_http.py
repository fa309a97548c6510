"""The fuzzer's HTTP side: `kvengine serve` fed broken JSON, wrong types and oversized bodies.

Each case must end in a clear answer within its deadline: a 4xx whose body says what is wrong
(OpenAI's ``{"error": {"message": ...}}``; 413 past the body limit), or — for the few cases that
happen to be valid — a 200 with a complete answer. A 5xx, a hang or a connection dropped without
an answer is a crash; and after the run the server must still answer /health and a completion.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx

from bench.soak.fuzz import Tally, run_cases
from bench.soak.fuzz_cases import http_bodies
from engine.server import MAX_BODY_BYTES

VALID = {"prompt": "Hello", "max_tokens": 1, "temperature": 0}


def verdict(status: int, body: bytes, stream: bool = False) -> str | None:
    """Why this answer is not a clear one, or None."""
    if status >= 500:
        return f"HTTP {status}: {body[:200]!r}"
    if status >= 400:
        try:
            doc = json.loads(body)
        except ValueError:
            return f"HTTP {status} whose body is not JSON: {body[:120]!r}"
        err = doc.get("error") if isinstance(doc, dict) else None  # every error, 404/405/413 included
        if not (isinstance(err, dict) and err.get("message")):
            return f"HTTP {status} without an OpenAI-style error message: {body[:120]!r}"
        return None
    if status != 200:
        return f"HTTP {status}"
    if stream or body.startswith(b"data:"):
        return None if body.rstrip().endswith(b"data: [DONE]") else f"a stream that does not end in [DONE]: {body[-120:]!r}"
    try:
        doc = json.loads(body)
    except ValueError:
        return f"HTTP 200 whose body is not JSON: {body[:120]!r}"
    return None if isinstance(doc, dict) and doc.get("choices") else f"HTTP 200 without choices: {body[:120]!r}"


def _chunks(total: int, step: int = 1 << 20) -> Iterator[bytes]:
    """A body with no Content-Length (sent chunked): JSON that never closes."""
    yield b'{"prompt": "'
    for _ in range(0, total, step):
        yield b"x" * step


def fuzz_http(base: str, n: int, seed: int, deadline_s: float = 30.0, max_body_bytes: int = MAX_BODY_BYTES,
              api_key: str = "") -> Tally:  # fmt: skip
    """``n`` cases against the server at ``base``: mostly malformed bodies, a few oversized ones
    (``api_key``: sent with each, for a server that takes API keys, so the bodies are read)."""
    tally = Tally()
    big = max(2, n // 200)
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(base_url=base, timeout=deadline_s, headers=auth) as c:

        def post(path: str, **kw: object) -> tuple[int, bytes] | str:
            try:
                r = c.post(path, headers={"content-type": "application/json"}, **kw)  # type: ignore[arg-type]
                return r.status_code, r.content
            except httpx.TimeoutException:
                return f"no answer within {deadline_s} s"
            except httpx.HTTPError as e:
                return f"{type(e).__name__}: {e}"

        def one(case: tuple[str, bytes]) -> None:
            path, body = case
            got = post(path, content=body)
            why = got if isinstance(got, str) else verdict(*got)
            tally.record("http", "crash" if why else str(got[0]), why, case)  # type: ignore[index]

        run_cases(http_bodies(), n - big, seed, one, tally, "http")
        for i in range(big):  # over the limit: declared (Content-Length), and streamed without one
            over = max_body_bytes + 1 + i * (max_body_bytes // 2)
            kw = {"content": b" " * over} if i % 2 == 0 else {"content": _chunks(over)}
            got = post("/v1/completions", **kw)
            why = got if isinstance(got, str) else (None if got[0] == 413 else f"HTTP {got[0]} for {over} bytes")
            tally.record("http", "crash" if why else "413", why, f"{over} bytes, {'declared' if i % 2 == 0 else 'chunked'}")
        why = None
        try:
            if c.get("/health").status_code != 200:
                why = "/health no longer 200"
            elif (r := c.post("/v1/completions", json=VALID)).status_code != 200 or verdict(r.status_code, r.content):
                why = f"a valid completion after the run: HTTP {r.status_code}"
        except httpx.HTTPError as e:
            why = f"server no longer answers: {type(e).__name__}: {e}"
        tally.record("http-after", "ok" if why is None else "bad", why)
    return tally
