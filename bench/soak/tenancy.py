"""The soak's tenants as credentials (docs/operations.md, "Tenants"): one daemon credential per
tenant, one for the engines listing every tenant they serve, one admin; one API key per tenant
for the engines. Written once per run under the work directory, 0600, never printed.

Tenants: the load's (``LOAD_TENANTS``, bench/soak/load.py), ``reference`` (the cold references,
each under a salt of its own) and ``probe`` (the private prompts and forged blocks of the probes:
no client of the load ever sends it, so the blocks under its tag in Redis are exactly the ones a
probe wrote, bench/soak/tenant_probes.py).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

LOAD_TENANTS = ("tenant-a", "tenant-b", "tenant-c")
REFERENCE, PROBE = "reference", "probe"
ALL_TENANTS = (*LOAD_TENANTS, REFERENCE, PROBE)


def _token() -> str:
    return secrets.token_urlsafe(24)


@dataclass(frozen=True)
class SoakCredentials:
    """Every secret of one run: the daemon's tokens and the engines' API keys (never logged)."""

    admin: str = field(default_factory=_token, repr=False)
    engines: str = field(default_factory=_token, repr=False)
    daemon: dict[str, str] = field(default_factory=lambda: {t: _token() for t in ALL_TENANTS}, repr=False)
    api: dict[str, str] = field(default_factory=lambda: {t: _token() for t in ALL_TENANTS}, repr=False)

    def write(self, work: Path) -> tuple[Path, Path]:
        """(the daemon's credentials file, the engines' API keys file), both 0600."""
        lines = ["credentials:", f'  - token: "{self.admin}"', "    admin: true",
                 f'  - token: "{self.engines}"', f"    tenants: [{', '.join(ALL_TENANTS)}]"]  # fmt: skip
        for tenant, tok in self.daemon.items():
            lines += [f'  - token: "{tok}"', f"    tenants: [{tenant}]"]
        creds = _private(work / "credentials.yaml", "\n".join(lines) + "\n")
        keys = _private(work / "api_keys.yaml", "".join(f'"{k}": {t}\n' for t, k in self.api.items()))
        return creds, keys


def _private(path: Path, text: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path
