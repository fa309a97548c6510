"""`kvengine serve`'s HTTP API fuzzed (bench/soak/fuzz_http.py): broken JSON, wrong types and
oversized bodies each get a clear 4xx (413 past the body limit), never a 5xx or a hang, the
server's memory does not take an oversized body in, and it still answers afterwards."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.servers import engine_server
from bench.soak.fuzz_http import fuzz_http, verdict
from engine.model_loader import hf_model_dir
from engine.server import MAX_BODY_BYTES
from tests.fixtures_model import make_tiny_llama

pytestmark = pytest.mark.timeout(300)
CASES = 300


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], base: str, log: Path) -> None:
        self.proc, self.base, self.log = proc, base, log

    def rss_mb(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS:")).split()[1]) / 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The tiny random Llama with SmolLM2's chat template, so chat bodies get past the template."""
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny-chat"))
    shutil.copy(hf_model_dir("") / "chat_template.jinja", model / "chat_template.jinja")
    log = tmp_path_factory.mktemp("http") / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERKV_")}
    with engine_server("--model", str(model), "--threads", "1", "--kv-memory", "16Mi", env=env, inherit_env=False,
                       log_path=log, timeout_s=240) as engine:  # fmt: skip
        yield Server(engine.proc, engine.base, log)


def test_fuzzed_bodies_get_clear_answers(server: Server) -> None:
    tally = fuzz_http(server.base, CASES, seed=0, deadline_s=60)
    assert tally.total == CASES + 1  # and the after-check
    assert tally.crashes == 0, tally.crash_cases[:3]
    assert tally.outcomes["http 413"] >= 1 and tally.outcomes["http 400"] > CASES // 3
    assert "Traceback" not in server.log.read_text()


@pytest.mark.parametrize("how", ["declared", "chunked"])
def test_an_oversized_body_is_413_and_never_held(server: Server, how: str) -> None:
    """Without the limit the server read the whole body (its RSS rose by twice the 64 MiB sent),
    then refused it as bad JSON (400)."""
    size = 4 * MAX_BODY_BYTES
    before = server.rss_mb()
    peak, done = [before], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], server.rss_mb())
            time.sleep(0.01)

    def body() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(size // (1 << 20)):
            yield b"x" * (1 << 20)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = httpx.post(server.base + "/v1/completions", content=b"x" * size if how == "declared" else body(),
                       timeout=120, headers={"content-type": "application/json"})  # fmt: skip
    finally:
        done.set()
        watcher.join()
    assert r.status_code == 413 and "Too Large" in r.text, r.text
    error = r.json()["error"]  # the one error body, whichever layer refused it
    assert error["type"] == "invalid_request_error" and re.match(r"Content Too Large: at most \d+ bytes of body are "
                                                                 r"accepted, the body (has \d+ bytes|is longer)", error["message"]), error
    assert peak[0] - before < size / 2**20 / 2, (before, peak[0])  # far below the body's 64 MiB
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200


def test_an_unknown_path_or_method_gets_the_same_error_body(server: Server) -> None:
    """Starlette's own 404/405 went out as FastAPI's ``{"detail": ...}``; now as every other error."""
    for r in (httpx.get(server.base + "/v1/nope", timeout=10), httpx.get(server.base + "/v1/completions", timeout=10)):
        assert r.status_code in (404, 405) and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert r.json()["error"]["message"] in ("Not Found", "Method Not Allowed"), r.text


def test_a_refused_body_is_not_read_to_its_end(server: Server) -> None:
    """The 413 says ``connection: close`` and the server closes at once, with 63 of the declared 64 MiB
    never sent. Without it the server kept the connection to read the rest (16 MB bodies refused one
    after another: the engine read 1.7 GB/s, bench.soak ``dos.stop_strings``); here it waited forever."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(server.base)
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % (64 << 20) + b'{"prompt": "' + b"x" * (1 << 20))
        sock.settimeout(10)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:  # the unread bytes make the close a reset: the server did close
            pass
    head = answer.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 413") and b"connection: close" in head, answer[:300]


def test_a_model_without_a_chat_template_answers_chat_with_400(tiny) -> None:
    """Was a 500 (transformers' ValueError from apply_chat_template); found fuzzing the tiny model."""
    from fastapi.testclient import TestClient

    from engine.async_engine import AsyncEngine
    from engine.server import create_app
    from tests.fixtures_engine import make_engine

    aengine = AsyncEngine(make_engine(tiny))
    aengine.start()
    try:
        with TestClient(create_app(aengine, "tiny")) as http:
            r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
            ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    finally:
        aengine.shutdown()
    assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
    assert ok.status_code == 200


def test_the_verdict_can_fail() -> None:
    assert verdict(500, b"Internal Server Error")
    assert verdict(400, b"not json")
    assert verdict(422, b'{"other": 1}')
    assert verdict(404, b'{"detail": "Not Found"}')  # FastAPI's own shape: the engine answers every error one way
    assert verdict(200, b"data: {}\n\n", stream=True)  # no [DONE]
    assert verdict(400, b'{"error": {"message": "bad"}}') is None
    assert verdict(200, b'{"choices": [{}]}') is None
