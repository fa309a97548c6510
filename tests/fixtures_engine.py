"""The one way tests build an engine: ``make_engine(loaded, **config)``.

``config`` is ``EngineConfig``'s own fields over the tests' defaults (``TEST_ENGINE``): a 64-page
pool of 16-token pages, a step budget no test prompt exceeds, and two torch threads. A test that
needs a field as ``EngineConfig`` has it by default passes it (``num_threads=0`` leaves torch's
thread count alone, as the single-threaded tests need).
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.engine import LLMEngine

TEST_ENGINE: dict[str, object] = dict(num_pages=64, page_size=16, num_threads=2, max_prefill_tokens=4096)


def make_engine(loaded, **config: object) -> LLMEngine:
    return LLMEngine(EngineConfig(**{**TEST_ENGINE, **config}), loaded=loaded)  # type: ignore[arg-type]
