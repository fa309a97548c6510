"""The shipped deployments isolate tenants: the daemon reads a credentials file (token -> tenant,
plus an admin token for operators), and each engine holds its own tenant's token and no other:
never the admin token, never another tenant's. Checked against the real credentials loader
(kvstore/server/credentials.py) and our CLIs, with stand-in tokens where the Secrets would be."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from kvstore.block import encode_block
from kvstore.client.client import KVStoreClient
from kvstore.client.retry import Retry
from kvstore.errors import PermissionDenied
from kvstore.keys import Namespace, chain_keys
from kvstore.server.auth import ClientAuth
from kvstore.server.credentials import CredentialTable, load_credentials
from kvstore.server.daemon import Daemon as ServedDaemon
from tests.deploy.support import (
    COMPOSE,
    check_config,
    compose_config_stand_ins,
    compose_daemon_command,
    k8s_credentials_stand_in,
    manifests,
)
from tests.fixtures_kvstore import connect, fetch, served


def _flag(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def _connector_config(argv: list[str]) -> dict | None:
    cfg = _flag(argv, "--kv-transfer-config")
    return json.loads(cfg)["kv_connector_extra_config"] if cfg else None


def _engine_tenant(argv: list[str], env: dict[str, str]) -> str:
    """The one tenant an engine's requests belong to (kvengine --tenant, or the vLLM connector's)."""
    extra = _connector_config(argv)
    tenant = extra.get("tenant") if extra is not None else _flag(argv, "--tenant") or env.get("TIERKV_ENGINE_TENANT")
    assert tenant, f"{argv[:3]}: serves no tenant of its own: its requests would land in one namespace"
    return tenant


def _assert_own_tenant_only(where: str, table: CredentialTable, tenant: str, token: str) -> None:
    caller = table.caller(token)
    assert caller is not None, f"{where}: its token is none of the daemon's credentials"
    assert not caller.admin, f"{where}: holds the admin token (reads and writes every tenant)"
    assert caller.tenants == (tenant,), f"{where}: its token reaches {caller.tenants}, it serves {tenant!r}"


# -- docker-compose.yml ---------------------------------------------------------------------------


def _compose_clients() -> dict[str, dict]:
    return {n: s for n, s in COMPOSE["services"].items()
            if n != "kvstore" and "kvstore:50051" in " ".join(map(str, s.get("command", [])))}  # fmt: skip


def _compose_token_file(svc: dict) -> str:
    extra = _connector_config([str(a) for a in svc["command"]])
    env = svc.get("environment") or {}
    assert "TIERKV_TOKEN" not in env, "a token value in the environment"
    path = extra.get("token_file") if extra is not None else env.get("TIERKV_TOKEN_FILE")
    assert path and path.startswith("/run/secrets/"), f"the daemon token is not a compose secret: {path}"
    assert path.removeprefix("/run/secrets/") in svc.get("secrets", []), f"{path} is not mounted"
    return path.removeprefix("/run/secrets/")


def test_compose_daemon_reads_a_credentials_file(tmp_path: Path) -> None:
    kv = COMPOSE["services"]["kvstore"]
    assert not {"TIERKV_TOKEN", "TIERKV_TOKEN_FILE"} & set(kv.get("environment") or {})
    assert "--no-auth" not in kv["command"]
    res = check_config(*compose_daemon_command(tmp_path))
    assert res.returncode == 0, res.stderr
    (line,) = [ln for ln in res.stdout.splitlines() if ln.startswith("auth:")]
    assert re.match(r"auth: \d+ credentials in \S+ \(tokens hidden\), tenants: \w", line), line


def test_compose_each_engine_holds_its_own_tenants_token_only(tmp_path: Path) -> None:
    (creds,) = compose_config_stand_ins(tmp_path, "kvstore").values()
    table = load_credentials(creds)
    clients = _compose_clients()
    assert {"engine-a", "engine-b", "vllm"} <= set(clients)
    served = set()
    for name, svc in clients.items():
        argv, env = [str(a) for a in svc["command"]], {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        tenant = _engine_tenant(argv, env)
        served.add(tenant)
        _assert_own_tenant_only(name, table, tenant, (tmp_path / _compose_token_file(svc)).read_text())
    assert len(served) > 1, "every engine in one tenant: the shipped setup shows no isolation"
    for name, svc in COMPOSE["services"].items():  # no other service (Redis, S3, Prometheus...) holds a token either
        if name == "kvstore":
            continue
        for secret in svc.get("secrets", []):
            if (tmp_path / secret).exists() and (caller := table.caller((tmp_path / secret).read_text())):
                assert name in clients and not caller.admin, f"{name} holds the token of {caller.label}"


# -- deploy/k8s/ ----------------------------------------------------------------------------------


def _k8s_engine_secret(obj: dict) -> tuple[str, str]:
    """The (Secret, key) an engine's or vLLM's daemon token comes from."""
    spec = obj["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    env = {e["name"]: e for e in c.get("env", [])}
    extra = _connector_config(c["command"])
    if extra is None:
        ref = env["TIERKV_TOKEN"]["valueFrom"]["secretKeyRef"]
        return ref["name"], ref["key"]
    path = extra["token_file"]
    (mount,) = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    rel = path[len(mount["mountPath"].rstrip("/")) + 1:]
    for src in vol["projected"]["sources"]:
        for item in src.get("secret", {}).get("items", []):
            if item["path"] == rel:
                return src["secret"]["name"], item["key"]
    raise AssertionError(f"{path}: from no Secret")


def _k8s_secrets_of(obj: dict) -> set[str]:
    spec = obj["spec"]["template"]["spec"]
    names = {e["valueFrom"]["secretKeyRef"]["name"] for c in spec["containers"] for e in c.get("env", [])
             if "secretKeyRef" in e.get("valueFrom", {})}  # fmt: skip
    for v in spec.get("volumes", []):
        names |= {v["secret"]["secretName"]} if "secret" in v else set()
        names |= {s["secret"]["name"] for s in v.get("projected", {}).get("sources", []) if "secret" in s}
    return names


def test_k8s_daemon_reads_a_credentials_file(tmp_path: Path) -> None:
    (ds,) = manifests("DaemonSet")
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    assert "--no-auth" not in c["command"] and "TIERKV_TOKEN" not in {e["name"] for e in c.get("env", [])}
    creds, tokens = k8s_credentials_stand_in(tmp_path)
    table = load_credentials(creds)
    assert sum(1 for t in tokens.values() if (caller := table.caller(t)) is not None and caller.admin) == 1


def test_k8s_each_engine_holds_its_own_tenants_token_only(tmp_path: Path) -> None:
    creds, tokens = k8s_credentials_stand_in(tmp_path)
    table = load_credentials(creds)
    admin = {secret for (secret, _), t in tokens.items() if table.caller(t) and table.caller(t).admin}  # type: ignore[union-attr]
    served = set()
    for obj in manifests("Deployment"):
        name = obj["metadata"]["name"]
        (c,) = obj["spec"]["template"]["spec"]["containers"]
        tenant = _engine_tenant(c["command"], {e["name"]: e.get("value", "") for e in c.get("env", [])})
        served.add(tenant)
        ref = _k8s_engine_secret(obj)
        assert ref in tokens, f"{name}: its token {ref} is none the daemon's credentials file names"
        _assert_own_tenant_only(name, table, tenant, tokens[ref])
        assert not admin & _k8s_secrets_of(obj), f"{name} mounts the admin token's Secret"
        others = {s for (s, _), t in tokens.items() if (cl := table.caller(t)) and tenant not in cl.tenants}
        assert not others & _k8s_secrets_of(obj), f"{name} mounts another tenant's token"
    assert len(served) > 1, "every workload in one tenant: the shipped setup shows no isolation"


def test_compose_credentials_isolate_the_engines_on_a_real_daemon(tmp_path: Path) -> None:
    """The shipped credentials file, served: each engine's token writes and reads its own tenant's
    blocks and is refused another engine's; the admin token reads both."""
    (creds,) = compose_config_stand_ins(tmp_path, "kvstore").values()
    clients = _compose_clients()
    ns = Namespace.from_model({"n_layer": 2}, "sha256:deploy", "float32", page_size=4)
    engines = []
    for svc in clients.values():
        argv = [str(a) for a in svc["command"]]
        tenant = _engine_tenant(argv, {k: str(v) for k, v in (svc.get("environment") or {}).items()})
        key = chain_keys(ns.in_tenant(tenant), [1, 2, 3, 4])[0]
        engines.append(((tmp_path / _compose_token_file(svc)).read_text(), key))
    admin = next(tok for tok in (p.read_text() for p in tmp_path.iterdir() if p.is_file() and p != creds)
                 if (c := load_credentials(creds).caller(tok)) is not None and c.admin)  # fmt: skip

    def block(k: bytes) -> bytes:
        return encode_block(k, np.full(4096, 3, np.uint8))

    def client(d: ServedDaemon, token: str) -> KVStoreClient:
        return connect(d, deadline_s=10.0, retry=Retry(attempts=1), auth=ClientAuth(token), use_shm=False)

    with served(tmp_path / "daemon", "--cpu", "64MiB", "--credentials-file", str(creds)) as d:
        for token, key in engines:
            with client(d, token) as c:
                assert c.put(key, block(key)) and fetch(c, [key]) == [block(key)]
        for i, (token, _) in enumerate(engines):
            with client(d, token) as c:
                for j, (_, other) in enumerate(engines):
                    if i != j:
                        with pytest.raises(PermissionDenied):
                            c.lookup([other])
        with client(d, admin) as ops:
            assert fetch(ops, [k for _, k in engines]) == [block(k) for _, k in engines]
