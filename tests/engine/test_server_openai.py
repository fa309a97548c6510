"""The official openai client against a running `kvengine serve` (real SmolLM2, CPU)."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from bench.servers import engine_server

pytestmark = pytest.mark.slow

SYSTEM = ("You are a meticulous travel assistant. You answer questions about cities, trains, museums "
          "and food. Always answer in one short sentence and never invent facts. ") * 3


@pytest.fixture(scope="module")
def server():
    with engine_server("--kv-memory", "128MiB", "--threads", "2", timeout_s=180, grace_s=20) as engine:
        yield engine.base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


def _metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics").text
    m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def test_models(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["SmolLM2-135M-Instruct"]


def test_completion(client):
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is",
                                  max_tokens=8, temperature=0)
    assert r.choices[0].text.strip().startswith("Paris")
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == 5
    assert r.choices[0].finish_reason == "length"


def test_chat_completion(client):
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=20, temperature=0,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"


def test_streaming_matches_non_streaming(client):
    kw = dict(model="SmolLM2-135M-Instruct", max_tokens=16, temperature=0,
              messages=[{"role": "user", "content": "Name three colours."}])
    full = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    parts = list(client.completions.create(model="SmolLM2-135M-Instruct", prompt="1, 2, 3,", max_tokens=6,
                                           temperature=0, stream=True))
    assert len(parts) >= 2 and parts[-1].choices[0].finish_reason == "length"


def test_cached_tokens_on_repeated_prefix(client):
    def ask(q: str):
        return client.chat.completions.create(
            model="SmolLM2-135M-Instruct", max_tokens=4, temperature=0,
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
    first = ask("Which museum in Paris has the Mona Lisa?")
    second = ask("How long is the train from Paris to Lyon?")
    assert first.usage.prompt_tokens > 64
    assert second.usage.prompt_tokens_details.cached_tokens >= 64


def test_stop_string_and_seed(client):
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="1, 2, 3, 4,", max_tokens=20,
                                  temperature=0, stop=[" 7"])
    assert "7" not in r.choices[0].text and r.choices[0].finish_reason == "stop"
    kw = dict(model="SmolLM2-135M-Instruct", prompt="My favourite animal is", max_tokens=12, temperature=1.0,
              top_p=0.9, seed=1234)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


@pytest.mark.parametrize("body,param", [
    ({"model": "SmolLM2-135M-Instruct"}, "prompt"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "n": 2}, "n"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**7}, "max_tokens"),
    ({"prompt": "hi", "model": "gpt-4"}, "model"),
    ({"prompt": [10**9]}, "prompt"),
])
def test_bad_requests_get_openai_400(server, body, param):
    r = httpx.post(server + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert param in (err["param"] or "")


def test_malformed_json_is_400(server):
    r = httpx.post(server + "/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_client_disconnect_frees_pages(server):
    with httpx.stream("POST", server + "/v1/completions", timeout=60,
                      json={"prompt": "Tell me a very long story.", "max_tokens": 1500, "stream": True,
                            "ignore_eos": True}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break
    deadline = time.time() + 30
    while time.time() < deadline and _metric(server, "tierkv_engine_running_requests") > 0:
        time.sleep(0.2)
    assert _metric(server, "tierkv_engine_running_requests") == 0
    assert _metric(server, 'tierkv_engine_requests_total{finish_reason="abort"}') >= 1


def test_metrics_exposed(server):
    text = httpx.get(server + "/metrics").text
    for name in ("tierkv_engine_ttft_seconds_bucket", "tierkv_engine_time_per_output_token_seconds_bucket",
                 "tierkv_engine_queue_depth", "tierkv_engine_kv_pool_usage_ratio",
                 "tierkv_engine_prefix_hit_tokens_total"):
        assert name in text


DOCS = ["The Zorblat river flows through the town of Mirvale and is 212 km long.",
        "Mirvale was founded in 1432 by the weaver Anna Kestrel.",
        "The main export of Mirvale is blue wool, sold every Tuesday at the river market."]


def test_chat_with_documents_is_blended(server, client):
    from transformers import AutoTokenizer

    from connector.blend import build_chat_blend_request
    from engine.model_loader import hf_model_dir

    msgs = [{"role": "user", "content": "Who founded Mirvale?"}]
    full = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=12,
                                          temperature=0, extra_body={"documents": DOCS, "blend_ratio": 1.0})
    # r = 1 recomputes everything: same tokens as a plain prefill of the same prompt ids
    ids, _ = build_chat_blend_request(AutoTokenizer.from_pretrained(hf_model_dir("")), msgs, DOCS, 1.0)
    plain = client.completions.create(model="SmolLM2-135M-Instruct", prompt=ids, max_tokens=12, temperature=0)
    assert full.choices[0].message.content == plain.choices[0].text
    assert full.usage.prompt_tokens == len(ids)
    partial = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=msgs, max_tokens=12,
                                             temperature=0, extra_body={"documents": DOCS[::-1]})
    assert partial.choices[0].message.content
    text = httpx.get(server + "/metrics").text
    assert re.search(r"^tierkv_blend_\w+ [1-9]", text, re.M), "blend metrics must count the blended requests"


def test_completion_with_blend_separator(server):
    body = {"prompt": "Facts:|" + "|".join(DOCS) + "|Question: how long is the Zorblat river? Answer:",
            "blend_separator": "|", "max_tokens": 8, "temperature": 0}
    r = httpx.post(server + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    bad = httpx.post(server + "/v1/completions", json={**body, "prompt": "no separators here"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
