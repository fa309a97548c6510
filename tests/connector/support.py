"""Helpers shared by the connector tests (no tests here): attaching the connector, prompts, greedy runs.

Daemons and clients come from tests/fixtures_kvstore.py, engines from tests/fixtures_engine.py."""

from __future__ import annotations

import ctypes

import numpy as np

from connector.connector import KVConnector
from connector.wiring import attach_tierkv, detach_tierkv
from engine.engine import LLMEngine
from engine.request import Request, Status
from engine.sampling import SamplingParams

#: a fixed prefill model for tests that do not exercise the cost model (no start-up calibration)
FIXED_PREFILL = (0.01, 1e-3, 1e-7)


def attach(engine: LLMEngine, address: str, **kw: object) -> KVConnector:
    opts: dict[str, object] = dict(calibrate=False, prefill_coeffs=FIXED_PREFILL, probe=False, load_mode="always")
    opts.update(kw)
    return attach_tierkv(engine, address, **opts)


def detach(engine: LLMEngine) -> None:
    detach_tierkv(engine)


def flip_in_place(tier, key: bytes, back: int = 100) -> None:
    """XOR one payload byte of the block an in-process daemon's cpu tier holds (through its zero-copy
    view): the daemon does not re-verify its top tier, so only the reader can catch it."""
    view = tier.get(key)
    arr = np.frombuffer(view, dtype=np.uint8)
    addr = arr.__array_interface__["data"][0] + len(arr) - back
    byte = ctypes.c_uint8.from_address(addr)
    byte.value ^= 0xFF
    del arr, view
    assert np.frombuffer(tier.get(key), dtype=np.uint8)[-back] == byte.value  # the tier's bytes changed


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(100, 40000, n)]


def run(engine: LLMEngine, ids: list[int], max_tokens: int = 6, salt: str | None = None) -> Request:
    rid = engine.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), cache_salt=salt)
    req = engine.requests[rid]
    while req.status is not Status.FINISHED:
        engine.step()
    return req
