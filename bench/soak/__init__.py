"""The soak, ``python -m bench.soak --out F.json [--quick]``: run.py (the plan, the fault schedule, the
JSON), cluster.py (redis, SeaweedFS, the daemon and two kvengine replicas), load.py (the tenants' streaming
clients), probes.py (auth and cross-tenant probes), watch.py (RSS, fds and shm per process), figures.py;
fuzz.py (``python -m bench.soak.fuzz``) with fuzz_cases.py, fuzz_grpc.py and fuzz_http.py.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.soak`` (bench/soak/run.py), imported when called so that importing one part
    of the bench does not load all of it."""
    from bench.soak.run import main as run

    return run(argv)
