"""Helpers shared by the connector tests (no tests here): daemons, engines, greedy runs."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from connector.connector import KVConnector
from connector.wiring import attach_tierkv, detach_tierkv
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.request import Request, Status
from engine.sampling import SamplingParams
from tests.test_kvstore_daemon import Daemon

#: a fixed prefill model for tests that do not exercise the cost model (no start-up calibration)
FIXED_PREFILL = (0.01, 1e-3, 1e-7)


@contextmanager
def daemon(tmp: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[Daemon]:
    work = tmp / f"daemon-{uuid.uuid4().hex[:8]}"
    work.mkdir(parents=True)
    d = Daemon(work, *flags, env=env).start()
    try:
        yield d
    finally:
        d.stop()


def make_engine(loaded, num_pages: int = 64, page_size: int = 16) -> LLMEngine:
    cfg = EngineConfig(num_pages=num_pages, page_size=page_size, num_threads=2, max_prefill_tokens=4096)
    return LLMEngine(cfg, loaded=loaded)


def attach(engine: LLMEngine, address: str, **kw: object) -> KVConnector:
    opts: dict[str, object] = dict(calibrate=False, prefill_coeffs=FIXED_PREFILL, probe=False, load_mode="always")
    opts.update(kw)
    return attach_tierkv(engine, address, **opts)


def detach(engine: LLMEngine) -> None:
    detach_tierkv(engine)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(100, 40000, n)]


def run(engine: LLMEngine, ids: list[int], max_tokens: int = 6, salt: str | None = None) -> Request:
    rid = engine.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), cache_salt=salt)
    req = engine.requests[rid]
    while req.status is not Status.FINISHED:
        engine.step()
    return req
