"""The soak, ``python -m bench.soak --out F.json [--quick]``: run.py (the plan, the fault schedule, the
JSON), cluster.py (redis, SeaweedFS, the daemon and two kvengine replicas), tenancy.py (their credentials and
API keys), load.py (the tenants' streaming clients), probes.py (each round of probes: auth, then
tenant_probes.py's cross-tenant reads by every path and forge.py's forged blocks in Redis/S3), dos.py (DoS
probes against a normal client), shm_reclaim.py, watch.py (RSS, fds and shm per process), figures.py and
security_figures.py; fuzz.py (``python -m bench.soak.fuzz``) with fuzz_cases.py, fuzz_grpc.py and fuzz_http.py.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.soak`` (bench/soak/run.py), imported when called so that importing one part
    of the bench does not load all of it."""
    from bench.soak.run import main as run

    return run(argv)
