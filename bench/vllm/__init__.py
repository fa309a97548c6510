"""The vLLM bench, ``python -m bench.vllm --out F.json [--quick]``: run.py (vLLM alone, with a pool of the
whole working set, with tierkv, and kvengine with tierkv, at Poisson arrivals; the JSON), workload.py (the
multi-round chat and shared-prefix workloads, measured against the pool) and fidelity.py (greedy answers over
KV loaded from the daemon against vLLM's own prefix cache, one request at a time).
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.vllm`` (bench/vllm/run.py), imported when called so that importing one part
    of the bench does not load all of it."""
    from bench.vllm.run import main as run

    return run(argv)
