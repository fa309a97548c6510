"""What the deployment tests share (no tests here): the parsed docker-compose.yml and deploy/k8s/
manifests, and a deployment command line run through our real CLI with --check-config."""

from __future__ import annotations

import os
import re
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


def compose_config_stand_ins(tmp: Path, service: str) -> dict[str, Path]:
    """The compose configs ``service`` mounts (target -> a copy under ``tmp``), each /run/secrets/NAME
    in them pointing at a stand-in file under ``tmp`` (a random token, made on first use)."""
    out = {}
    for ref in COMPOSE["services"][service].get("configs", []):
        text = (ROOT / COMPOSE["configs"][ref["source"]]["file"]).read_text()
        for name in re.findall(r"/run/secrets/(\w+)", text):
            if not (tmp / name).exists():
                (tmp / name).write_text(os.urandom(32).hex())
        copy = tmp / Path(ref["target"]).name
        copy.write_text(text.replace("/run/secrets/", f"{tmp}/"))
        out[ref["target"]] = copy
    return out


def compose_daemon_command(tmp: Path) -> tuple[list[str], dict[str, str]]:
    """The compose daemon's command and environment, its configs replaced by stand-ins under ``tmp``
    (``compose_config_stand_ins``), ready for ``check_config``."""
    (argv, env) = next((a, e) for n, a, e in compose_commands() if n == "kvstore")
    configs = compose_config_stand_ins(tmp, "kvstore")
    return [str(configs.get(a, a)) for a in argv], env


def k8s_daemon_volume(name: str) -> dict:
    """The DaemonSet's volume ``name``."""
    (ds,) = manifests("DaemonSet")
    (vol,) = [v for v in ds["spec"]["template"]["spec"]["volumes"] if v["name"] == name]
    return vol


def k8s_credentials_stand_in(tmp: Path) -> tuple[Path, dict[tuple[str, str], str]]:
    """The daemon's credentials directory as kubelet would project it, under ``tmp``: the
    ConfigMap's files as shipped, each Secret's key a random token. Returns the path of the
    credentials file the DaemonSet's command names there, and (Secret, key) -> the token made."""
    (ds,) = manifests("DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    path = c["command"][c["command"].index("--credentials-file") + 1]
    (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    vol = k8s_daemon_volume(mount["name"])
    data = {d["metadata"]["name"]: d["data"] for d in manifests("ConfigMap")}
    tokens = {}
    for src in vol["projected"]["sources"]:
        for item in next(iter(src.values()))["items"]:
            dest = tmp / item["path"]
            dest.parent.mkdir(parents=True, exist_ok=True)
            if "configMap" in src:
                dest.write_text(data[src["configMap"]["name"]][item["key"]])
            else:
                tokens[(src["secret"]["name"], item["key"])] = token = os.urandom(32).hex()
                dest.write_text(token)
    return tmp / Path(path).relative_to(mount["mountPath"]), tokens
