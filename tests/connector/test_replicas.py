"""Two `kvengine serve --kvstore ADDR` processes on one daemon: the second replica answers a prompt
it never saw from KV the first one computed, and a CacheBlend request from document chunks the
first one computed (the CLI attach path, over HTTP)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from bench.servers import EngineServer
from tests.connector.support import prompt
from tests.fixtures_kvstore import daemon


@contextmanager
def _replicas(model_dir: Path, address: str, tmp_path: Path) -> Iterator[list[str]]:
    """Two healthy `kvengine serve` replicas on one daemon (loading side by side); yields their base URLs."""
    # write-through so the first replica offloads at once; the tiny model calibrates in a second
    env = {"TIERKV_CONNECTOR_WRITE_THROUGH": "1", "TIERKV_CONNECTOR_LOAD_MODE": "always"}
    flags = ("--model", str(model_dir), "--kvstore", address, "--num-pages", "128", "--threads", "1")
    with ExitStack() as stack:
        servers = [stack.enter_context(EngineServer(*flags, env=env, log_path=tmp_path / f"replica{i}.log", grace_s=20))
                   for i in range(2)]
        for server in servers:
            server.wait_ready(120)
        yield [server.base for server in servers]


def test_second_replica_reuses_the_first_replicas_prefix(tiny_model_dir: Path, tmp_path: Path) -> None:
    ids = prompt(300, seed=31)  # 18 full pages loadable
    with daemon(tmp_path, "--cpu", "64MiB") as d, _replicas(tiny_model_dir, d.address, tmp_path) as bases:
        model = httpx.get(bases[0] + "/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        a = httpx.post(bases[0] + "/v1/completions", json=body, timeout=60).json()
        assert "usage" in a, a
        assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        deadline = time.monotonic() + 30  # write-through is asynchronous: wait for the daemon
        while time.monotonic() < deadline:
            m = re.search(r'tierkv_connector_offload_blocks_total\{result="sent"\} (\S+)',
                          httpx.get(bases[0] + "/metrics").text)
            if m and float(m.group(1)) >= 18:
                break
            time.sleep(0.2)
        b = httpx.post(bases[1] + "/v1/completions", json=body, timeout=60).json()
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 288
        assert b["choices"][0]["text"] == a["choices"][0]["text"]
        metrics = httpx.get(bases[1] + "/metrics").text
        assert 'tierkv_connector_loaded_tokens_total{tier="cpu"} 288.0' in metrics


def _metric(base: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", httpx.get(base + "/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def test_second_replica_reuses_the_first_replicas_documents(tiny_model_dir: Path, tmp_path: Path) -> None:
    docs = ["The lighthouse of Orvik was built in 1852 by the engineer Talia Novak. ",
            "Orvik's harbour freezes every February, and the ferries stop for three weeks. "]
    sep = "\n###\n"
    text = sep.join(["Answer from the documents.\n", *docs, "Question: who built the lighthouse? Answer:"])
    with daemon(tmp_path, "--cpu", "64MiB") as d, _replicas(tiny_model_dir, d.address, tmp_path) as bases:
        body = {"prompt": text, "blend_separator": sep, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        a = httpx.post(bases[0] + "/v1/completions", json=body, timeout=60).json()
        assert "usage" in a, a
        assert _metric(bases[0], "tierkv_blend_chunk_misses_total") == 3  # prefix + 2 documents
        b = httpx.post(bases[1] + "/v1/completions", json=body, timeout=60).json()
        assert _metric(bases[1], "tierkv_blend_blended_requests_total") == 1
        assert _metric(bases[1], "tierkv_blend_chunk_misses_total") == 0  # every chunk from the daemon
        assert _metric(bases[1], "tierkv_blend_chunk_hits_total") == 3
        assert b["choices"][0]["text"] == a["choices"][0]["text"]
