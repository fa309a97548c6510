"""The deployment files turn auth on and give the daemon and its engines the same token."""

from __future__ import annotations

from tests.deploy.support import COMPOSE, check_config, compose_commands, manifests


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def test_compose_engines_read_the_daemon_token_file() -> None:
    services = COMPOSE["services"]
    kv = services["kvstore"]
    path = kv["environment"]["TIERKV_TOKEN_FILE"]
    (vol,) = [v for v in kv["volumes"] if v.split(":")[1] == path.rpartition("/")[0]]
    for name in ("engine-a", "engine-b"):
        svc = services[name]
        assert svc["environment"]["TIERKV_TOKEN_FILE"] == path, name
        assert f"{vol.split(':')[0]}:{path.rpartition('/')[0]}:ro" in svc["volumes"], name
    assert "--no-auth" not in kv["command"]
    (argv, env) = next((a, e) for n, a, e in compose_commands() if n == "kvstore")
    res = check_config(argv, env)
    assert res.returncode == 0 and f"auth: bearer token in {path}" in res.stdout, res.stdout + res.stderr


def test_k8s_daemon_and_engines_share_the_token_secret() -> None:
    (ds,) = manifests("DaemonSet")
    (dep,) = manifests("Deployment", "tierkv-engine")
    refs = []
    for obj in (ds, dep):
        (c,) = obj["spec"]["template"]["spec"]["containers"]
        assert "--no-auth" not in c["command"]
        refs.append(_env(c)["TIERKV_TOKEN"]["valueFrom"]["secretKeyRef"])
    assert refs[0] == refs[1]
