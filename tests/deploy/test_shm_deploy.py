"""The shared-memory path as shipped in docker-compose.yml and deploy/k8s/: every client of the
daemon sees its unix socket at the path the daemon binds (segments go over it as fds), nothing
shares an IPC namespace or the host's /dev/shm (tierkv keeps nothing there), and the daemon's
memory limit covers its cpu arena, which it now reserves whole at start."""

from __future__ import annotations

import posixpath

import yaml

from kvstore.config.sizes import parse_size
from kvstore.config.store_config import StoreConfig
from tests.deploy.support import COMPOSE, manifests

SPILL_QUEUE = StoreConfig.__dataclass_fields__["spill_queue_bytes"].default


def _compose_mounts(svc: dict) -> dict[str, str]:
    """Mount point -> volume name of a compose service."""
    return {v.split(":")[1]: v.split(":")[0] for v in svc.get("volumes", [])}


def test_compose_clients_see_the_daemons_shm_socket() -> None:
    services = COMPOSE["services"]
    kv = services["kvstore"]
    cmd = [str(a) for a in kv["command"]]
    where = posixpath.dirname(cmd[cmd.index("--shm-socket") + 1])
    volume = _compose_mounts(kv).get(where)
    assert volume in COMPOSE["volumes"], f"the daemon's socket directory {where} is not a shared volume"
    clients = [n for n, s in services.items() if n != "kvstore" and "kvstore:50051" in " ".join(map(str, s["command"]))]
    assert {"engine-a", "engine-b", "vllm"} <= set(clients)
    for name in clients:
        assert _compose_mounts(services[name]).get(where) == volume, f"{name} cannot reach the daemon's shm socket"
    for name, svc in services.items():
        assert "ipc" not in svc, f"{name} shares an IPC namespace: tierkv needs none"
    assert "shm_size" not in kv, "the daemon keeps nothing in /dev/shm: a shm_size there sizes nothing"


def _k8s_mounts(obj: dict) -> dict[str, str]:
    """Mount point -> hostPath of a pod template's (only) container."""
    spec = obj["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    vols = {v["name"]: v for v in spec["volumes"]}
    return {m["mountPath"]: vols[m["name"]].get("hostPath", {}).get("path", "") for m in c["volumeMounts"]}


def test_k8s_clients_see_the_daemons_shm_socket() -> None:
    cfg = yaml.safe_load(manifests("ConfigMap")[0]["data"]["kvstore.yaml"])
    where = posixpath.dirname(cfg["shm_socket"])
    (ds,) = manifests("DaemonSet")
    host = _k8s_mounts(ds).get(where)
    assert host, f"the daemon's socket directory {where} is not on the node (hostPath)"
    for name in ("tierkv-engine", "tierkv-vllm"):
        (dep,) = manifests("Deployment", name)
        assert _k8s_mounts(dep).get(where) == host, f"{name} cannot reach the daemon's shm socket"
    for obj in [ds, *manifests("Deployment")]:
        spec = obj["spec"]["template"]["spec"]
        assert not spec.get("hostIPC"), f"{obj['metadata']['name']}: hostIPC exposes the node's IPC; tierkv needs none"
        assert "/dev/shm" not in [v.get("hostPath", {}).get("path") for v in spec.get("volumes", [])]


def test_k8s_daemon_memory_covers_its_reserved_arena() -> None:
    cfg = yaml.safe_load(manifests("ConfigMap")[0]["data"]["kvstore.yaml"])
    cpu = parse_size(next(t["capacity"] for t in cfg["tiers"] if t["kind"] == "cpu"))
    (ds,) = manifests("DaemonSet")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    for which in ("requests", "limits"):
        assert parse_size(c["resources"][which]["memory"]) >= cpu + SPILL_QUEUE, which
