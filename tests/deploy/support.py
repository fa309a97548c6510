"""What the deployment tests share (no tests here): the parsed docker-compose.yml and deploy/k8s/
manifests, and a deployment command line run through our real CLI with --check-config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
K8S = {p.name: list(yaml.safe_load_all(p.read_text())) for p in sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))}
CLIS = {"kvstore": "kvstore.cli", "kvengine": "engine.cli"}


def check_config(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (a deployment command line) with --check-config through our real CLI."""
    prog, *rest = argv
    cmd = [sys.executable, "-m", CLIS[prog], *rest, "--check-config"]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TIERKV_", "AWS_"))}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**base, "PYTHONPATH": str(ROOT), **(env or {})})


def compose_commands() -> list[tuple[str, list[str], dict[str, str]]]:
    out = []
    for name, svc in COMPOSE["services"].items():
        cmd = svc.get("command")
        if isinstance(cmd, list) and cmd and cmd[0] in CLIS:
            out.append((name, [str(c) for c in cmd], {k: str(v) for k, v in (svc.get("environment") or {}).items()}))
    return out


def manifests(kind: str, name: str | None = None) -> list[dict]:
    return [d for docs in K8S.values() for d in docs
            if d and d.get("kind") == kind and name in (None, d.get("metadata", {}).get("name"))]  # fmt: skip
