"""`kvengine serve` cannot be knocked over by one client: bounded stop strings, salts and prompts get a
one-line 400 before any work, a seed torch cannot take does not kill the engine loop, a multi-MiB prompt
is tokenised off the event loop while /health keeps answering, and past max_num_seqs + max_waiting
requests in flight the server answers 429 with Retry-After, taking requests again once they finish.

A real server process on the tiny random Llama (with SmolLM2's chat template), one request slot and one
waiting place, and the bounds on a prompt's characters and a body's bytes raised so that the big prompt
really is tokenised (the last tests check those bounds, on in-process servers)."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bench.servers import engine_server
from engine.model_loader import hf_model_dir, load_model
from tests.fixtures_model import make_tiny_llama

pytestmark = pytest.mark.timeout(300)
DEADLINE_S = 120  # generous: the box is shared


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory: pytest.TempPathFactory):
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny-chat"))
    shutil.copy(hf_model_dir("") / "chat_template.jinja", model / "chat_template.jinja")
    return model


@pytest.fixture(scope="module")
def server(tiny_chat, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("http") / "server.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERKV_")}
    with engine_server("--model", str(tiny_chat), "--threads", "1", "--kv-memory", "16Mi", "--max-num-seqs", "1",
                       "--max-waiting", "1", "--max-prompt-chars", str(16 * 2**20),
                       "--max-body-bytes", str(32 * 2**20), "--no-blend", env=env,
                       inherit_env=False, log_path=log, timeout_s=240) as engine:  # fmt: skip
        yield engine.base
    assert "Traceback" not in log.read_text()


def _error(r: httpx.Response, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and "\n" not in err["message"]
    return err["message"]


@pytest.mark.parametrize("body,param,msg", [
    ({"stop": [f"s{i}" for i in range(9)]}, "stop", "at most 8 stop strings"),
    ({"stop": ["x" * 10**6] * 16}, "stop", "at most 8 stop strings"),  # the review's probe: 16 x 1 MB
    ({"stop": ["x" * 257]}, "stop", "at most 256 characters"),
    ({"stop_token_ids": list(range(1000))}, "stop_token_ids", "at most 64 stop_token_ids"),
    ({"cache_salt": "s" * 257}, "cache_salt", "at most 256 bytes"),
    ({"cache_salt": "é" * 129}, "cache_salt", "at most 256 bytes"),  # 258 bytes in 129 characters
    ({"cache_salt": "\ud800"}, "cache_salt", "valid Unicode"),
    ({"seed": 2**70}, "seed", "seed must be in"),
    ({"max_tokens": 5000}, "max_tokens", "context length"),
])
def test_inputs_past_their_bounds_get_one_line_400(server: str, body: dict[str, Any], param: str, msg: str) -> None:
    raw = json.dumps({"prompt": "hi", "max_tokens": 2, **body}).encode()  # ASCII: a lone surrogate as its escape
    r = httpx.post(server + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                   timeout=DEADLINE_S)
    assert msg in _error(r, 400, param)
    ok = httpx.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=DEADLINE_S)
    assert ok.status_code == 200, ok.text  # nothing lost for anyone else (a bad seed killed the engine loop)


def test_bounds_hold_on_chat_too(server: str) -> None:
    r = httpx.post(server + "/v1/chat/completions", timeout=DEADLINE_S,
                   json={"messages": [{"role": "user", "content": "hi"}], "stop": ["y" * 300]})
    assert "at most 256 characters" in _error(r, 400, "stop")
    r = httpx.post(server + "/v1/chat/completions", timeout=DEADLINE_S,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                         "cache_salt": "t" * 256, "stop": ["z" * 256] * 8})
    assert r.status_code == 200, r.text  # at the bounds


def _gauge(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", timeout=DEADLINE_S).text
    return float(re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M).group(1))  # type: ignore[union-attr]


def _tokenizing(base: str) -> float:
    return _gauge(base, "tierkv_engine_api_prompts_tokenizing")


def _in_flight(base: str) -> float:
    return _gauge(base, "tierkv_engine_api_requests_in_flight")


def test_health_answers_while_a_huge_prompt_is_tokenised(server: str) -> None:
    """Tokenised on the event loop (as before), the 4 MiB prompt held every other request for seconds:
    no probe could be answered while it was being tokenised (the gauge is 1 only meanwhile)."""
    prompt = ("The lighthouse keeper counted ships and wrote their names down. " * 70_000)[: 4 * 2**20]
    done = threading.Event()
    big: list[httpx.Response] = []

    def post() -> None:
        try:
            big.append(httpx.post(server + "/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                                  timeout=DEADLINE_S * 2))
        finally:
            done.set()

    _wait_until(lambda: _tokenizing(server) == 0)  # nothing else is: what the probes see is the big one
    t = threading.Thread(target=post)
    t.start()
    seen_tokenizing = False
    try:
        while not done.is_set():
            before = _tokenizing(server)
            assert httpx.get(server + "/health", timeout=DEADLINE_S).status_code == 200
            if before == 1 and _tokenizing(server) == 1:
                seen_tokenizing = True  # /health answered between two looks that saw the one prompt tokenised
                break
    finally:
        t.join()
    assert seen_tokenizing
    assert "context length" in _error(big[0], 400, "prompt")  # it was tokenised, then refused: too long


def test_past_the_cap_a_request_gets_429_and_retry_after(server: str) -> None:
    """One running and one waiting request fill the server; without the cap a third joined the queue."""
    body = {"prompt": "Tell me a long story.", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=DEADLINE_S) as a, httpx.Client(timeout=DEADLINE_S) as b:
        with a.stream("POST", server + "/v1/completions", json=body) as r1, \
                b.stream("POST", server + "/v1/completions", json=body) as r2:
            assert r1.status_code == 200 and r2.status_code == 200
            r = httpx.post(server + "/v1/chat/completions", timeout=DEADLINE_S,
                           json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert "retry later" in _error(r, 429, None)
            assert r.json()["error"]["type"] == "rate_limit_error" and r.headers["retry-after"] == "1"
            assert httpx.get(server + "/health", timeout=DEADLINE_S).status_code == 200
    # both clients went away: their places free as the server notices (the next token it sends)
    ok = lambda: httpx.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},  # noqa: E731
                            timeout=DEADLINE_S).status_code == 200
    _wait_until(ok)
    _wait_until(lambda: _in_flight(server) == 0)


def _wait_until(cond: Any) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.2)


def test_prompt_characters_are_bounded_before_tokenising(tiny_chat) -> None:
    """Without the bound the 2,002-character prompts were tokenised and served."""
    from fastapi.testclient import TestClient

    from engine.async_engine import AsyncEngine
    from engine.server import create_app
    from tests.fixtures_engine import make_engine

    aengine = AsyncEngine(make_engine(load_model(str(tiny_chat)), max_model_len=1024, max_prompt_chars=2000))
    aengine.start()
    try:
        with TestClient(create_app(aengine, "tiny")) as http:
            r = http.post("/v1/completions", json={"prompt": "a " * 1001, "max_tokens": 1})
            assert "at most 2000 are accepted" in _error(r, 400, "prompt")
            r = http.post("/v1/chat/completions", json={"max_tokens": 1, "messages": [
                {"role": "system", "content": "b " * 500}, {"role": "user", "content": "c " * 501}]})
            assert "2002 characters" in _error(r, 400, "messages")
            r = http.post("/v1/completions", json={"prompt": [5] * 1025, "max_tokens": 1})
            assert "more than the model's context length" in _error(r, 400, "prompt")
            assert http.post("/v1/completions", json={"prompt": "a " * 999, "max_tokens": 1}).status_code == 200
    finally:
        aengine.shutdown()


def test_a_body_the_context_could_never_use_is_413_before_it_is_parsed(tiny_chat) -> None:
    """The bound follows the context (128 bytes a token, at least 1 MiB): with the old fixed 16 MiB the
    3 MiB body below was read and parsed on the event loop, and only then refused (400)."""
    from fastapi.testclient import TestClient

    from engine.async_engine import AsyncEngine
    from engine.limits import MIN_BODY_BYTES
    from engine.server import create_app
    from tests.fixtures_engine import make_engine

    def status(body_bytes: int, **cfg: Any) -> int:
        aengine = AsyncEngine(make_engine(load_model(str(tiny_chat)), **cfg))
        aengine.start()
        try:
            with TestClient(create_app(aengine, "tiny")) as http:
                prompt = "a " * ((body_bytes - 40) // 2)
                return http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code
        finally:
            aengine.shutdown()

    assert status(3 * 2**20, max_model_len=1024) == 413  # 1 MiB: the floor
    assert status(MIN_BODY_BYTES - 4096, max_model_len=1024) == 400  # read, parsed, refused: too many characters
    assert status(3 * 2**20, max_model_len=32768) == 400  # 4 MiB for a 32k context: parsed
    assert status(200_000, max_model_len=1024, max_body_bytes=100_000) == 413  # the flag sets it
