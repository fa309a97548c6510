"""The serving bench, ``python -m bench.serve --out F.json [--quick]``: run.py (the sweep and the JSON),
modes.py (what each mode serves: kvengine, its daemon, the daemon's backing server), workload.py (the QA and
RAG prompts), client.py (the OpenAI-API load generator), drive.py (the modes point by point), figures.py.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.serve`` (bench/serve/run.py), imported when called so that importing one part
    of the bench does not load all of it."""
    from bench.serve.run import main as run

    return run(argv)
