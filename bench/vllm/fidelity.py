"""Greedy answers over KV loaded from the daemon, against vLLM's own prefix cache, one request at a time.

Under concurrent load a bf16 answer depends on what else shares its batch: vLLM alone and the ideal
(the same vLLM with a bigger pool) differ from each other in a third or more of the timed points'
answers, so those cannot be compared token for token. This pass can, on one mode's server, for each
of a few prompts no earlier request sent:

1. the prompt, then the prompt again: the second answer runs over its full blocks from vLLM's own
   prefix cache ("local"); the first is a fresh prefill, and its blocks are written to the daemon;
2. fillers of new text, more blocks than the pool holds: vLLM evicts the prompt's blocks;
3. the prompt a third time: its full blocks come from the daemon ("loaded").

"loaded" must equal "local" token for token: the same KV bytes, split at the same block, in a batch of
one. And the connector must really have loaded every full block (its own counter on /metrics): a
check the cost model could skip by recomputing would prove nothing. How often the fresh prefill
differs is reported beside it: in bf16 a prefill split at a block boundary may differ from an
unsplit one, with or without tierkv (tests/connector/vllm/test_e2e.py saw the same).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.serve.client import Record, client, send

FILLER_TOKENS = 700  # a filler prompt's length: a few blocks of its own
LOADED = "tierkv_connector_vllm_blocks_total"


def loaded_blocks(metrics: dict[str, float]) -> float:
    """The connector's blocks loaded so far, from a /metrics snapshot (``name{labels}`` -> value)."""
    return sum(v for k, v in metrics.items() if k.partition("{")[0] == LOADED and 'event="loaded"' in k)


async def _answer(api: Any, model: str, key: str, messages: list[dict[str, str]], tokens: int) -> Record:
    rec = await send(api, model, key, messages, tokens)
    if rec.error is not None:
        raise RuntimeError(f"fidelity request {key} failed: {rec.error}")
    return rec


async def check(port: int, model: str, metrics: Callable[[], dict[str, float]], prompts: Sequence[Any],
                fillers: Sequence[Sequence[list[dict[str, str]]]], answer_tokens: int, block: int,
                publish_s: float = 20.0) -> dict[str, Any]:  # fmt: skip
    """Steps 1-3 for each of ``prompts`` (workload requests); ``fillers[i]`` (chat messages of new
    text) together hold more blocks than the pool. Per prompt and in total."""
    rows = []
    async with client(port) as api:  # closed in this loop (after asyncio.run, each connection logs a traceback)
        for i, p in enumerate(prompts):
            fresh = await _answer(api, model, f"{p.key}-fresh", p.messages, answer_tokens)
            local = await _answer(api, model, f"{p.key}-local", p.messages, answer_tokens)
            for j, f in enumerate(fillers[i]):
                await _answer(api, model, f"filler{i}.{j}", f, 2)
            await asyncio.sleep(0.5)  # the prompt's write-through saves land (they run off the step)
            before = loaded_blocks(metrics())
            again = await _answer(api, model, f"{p.key}-loaded", p.messages, answer_tokens)
            expected = (local.prompt_tokens - 1) // block  # vLLM computes the last prompt token itself
            end = time.monotonic() + publish_s  # vLLM publishes connector stats a step later
            got = loaded_blocks(metrics()) - before
            while got < expected and time.monotonic() < end:
                await asyncio.sleep(0.2)
                got = loaded_blocks(metrics()) - before
            rows.append({"key": p.key, "prompt_tokens": local.prompt_tokens, "expected_blocks": expected,
                         "loaded_blocks": int(got), "loaded_equals_local": again.text == local.text,
                         "fresh_equals_local": fresh.text == local.text})  # fmt: skip
    return summary(rows)


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals over the prompts: how many answers over loaded KV differ from the local hit's, and
    whether every prompt's full blocks were loaded (else the comparison did not test a load)."""
    return {"prompts": len(rows),
            "answers_loaded_differing_from_local": sum(not r["loaded_equals_local"] for r in rows),
            "answers_fresh_differing_from_local": sum(not r["fresh_equals_local"] for r in rows),
            "blocks_expected": sum(r["expected_blocks"] for r in rows),
            "blocks_loaded": sum(min(r["loaded_blocks"], r["expected_blocks"]) for r in rows),
            "all_blocks_loaded": bool(rows) and all(r["loaded_blocks"] >= r["expected_blocks"] > 0 for r in rows),
            "rows": rows}  # fmt: skip
