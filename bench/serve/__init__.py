"""The serving bench, ``python -m bench.serve --out F.json [--quick]``: run.py (runs, ratios, the JSON),
modes.py (what each mode serves: kvengine, its daemon, the daemon's backing server), workload.py (the QA and
RAG prompts), client.py (the OpenAI-API load generator), schedule.py (Poisson arrivals, the modes' order),
capacity.py (one mode's run: points and the knee), knee.py (the pass rule and the search), settle.py
(between modes and points), figures.py, rag.py, prefill_sweep.py (``--sweep-only``: max_prefill_tokens).
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.serve`` (bench/serve/run.py), imported when called so that importing one part
    of the bench does not load all of it."""
    from bench.serve.run import main as run

    return run(argv)
