"""docker-compose.yml, the Dockerfile and deploy/k8s/: parsed and checked against our own CLIs.

No Docker engine or cluster runs here, so every command line in the deployment files is run
through the real CLI with ``--check-config`` (validate and exit, nothing started), and the
manifests' structure is checked for what an operator relies on: health checks everywhere, the
node-local daemon address, probes and grace periods.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.support import (
    COMPOSE,
    K8S,
    ROOT,
    check_config,
    compose_commands,
    compose_config_stand_ins,
    k8s_credentials_stand_in,
    manifests,
)


def test_compose_services_and_health() -> None:
    services = COMPOSE["services"]
    assert {"redis", "s3", "kvstore", "engine-a", "engine-b", "prometheus"} <= set(services)
    for name, svc in services.items():
        assert "healthcheck" in svc, f"{name} has no health check"
    kv = services["kvstore"]
    assert any(":/var/lib/tierkv" in v for v in kv["volumes"]), "the disk tier needs a volume"
    for name in ("engine-a", "engine-b"):
        svc = services[name]
        assert "kvstore:50051" in svc["command"]
        assert svc["depends_on"]["kvstore"]["condition"] == "service_healthy"
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert {"kvstore:9400", "engine-a:8000", "engine-b:8000"} <= targets


@pytest.mark.parametrize("name,argv,env", compose_commands(), ids=[c[0] for c in compose_commands()])
def test_compose_command_accepted_by_our_cli(name: str, argv: list[str], env: dict[str, str],
                                            tmp_path: Path) -> None:
    configs = compose_config_stand_ins(tmp_path, name)  # what it mounts from compose configs, as mounted
    res = check_config([str(configs.get(a, a)) for a in argv], env)
    assert res.returncode == 0, f"{name}: {' '.join(argv)} rejected:\n{res.stderr[-2000:]}"


def test_check_config_rejects_bad_commands() -> None:
    """The check can fail: a bad size or an unknown flag is refused with one clear line."""
    bad = check_config(["kvstore", "serve", "--cpu", "lots"])
    assert bad.returncode != 0 and "lots" in bad.stderr
    assert "Traceback" not in bad.stderr
    bad = check_config(["kvengine", "serve", "--listen", "nowhere"])
    assert bad.returncode != 0 and "Traceback" not in bad.stderr


def test_compose_healthcheck_uses_real_subcommand() -> None:
    test = COMPOSE["services"]["kvstore"]["healthcheck"]["test"]
    assert test[1:3] == ["kvstore", "health"]
    out = subprocess.run([sys.executable, "-m", "kvstore.cli", "health", "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=60)
    assert out.returncode == 0 and "--address" in out.stdout


def test_k8s_daemonset() -> None:
    (ds,) = manifests("DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    (c,) = spec["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):  # exec: kubelet's gRPC probe has no TLS
        assert c[probe]["exec"]["command"][:4] == ["kvstore", "health", "--address", "localhost:50051"], probe
    assert c["resources"]["limits"]["memory"] and c["resources"]["requests"]["cpu"]
    vols = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert "hostPath" in vols[mounts["/var/lib/tierkv"]], "the disk tier sits on the node's NVMe (hostPath)"
    # the pod is given longer than the daemon's own grace + spill flush (grace_s in the config)
    cm = yaml.safe_load(manifests("ConfigMap")[0]["data"]["kvstore.yaml"])
    assert spec["terminationGracePeriodSeconds"] > cm["grace_s"]
    assert ds["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"


def _node_local_daemon(address: str) -> None:
    """``address`` is a Service that routes to the daemon pods of the caller's own node only."""
    host, _, port = address.rpartition(":")
    (svc,) = manifests("Service", host)
    (ds,) = manifests("DaemonSet")
    assert svc["spec"]["internalTrafficPolicy"] == "Local", "an engine must reach its own node's daemon"
    assert svc["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    (grpc_port,) = [p for p in svc["spec"]["ports"] if p["port"] == int(port)]
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    assert grpc_port["targetPort"] in {p["name"] for p in c["ports"] if p["containerPort"] == 50051}


def test_k8s_engine_finds_node_local_daemon() -> None:
    (dep,) = manifests("Deployment", "tierkv-engine")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    _node_local_daemon(c["command"][c["command"].index("--kvstore") + 1])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health", probe
    (svc,) = manifests("Service", "tierkv-engine")
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    kust = K8S["kustomization.yaml"][0]
    assert set(kust["resources"]) == set(K8S) - {"kustomization.yaml"}


@pytest.mark.parametrize("kind", ["DaemonSet", "Deployment"])
def test_k8s_commands_accepted_by_our_cli(kind: str, tmp_path: Path) -> None:
    (obj,) = manifests(kind, {"DaemonSet": None, "Deployment": "tierkv-engine"}[kind])
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    argv = [a.replace("$(POD_IP)", "10.0.0.2") for a in c["command"]]
    cfg = yaml.safe_load(manifests("ConfigMap")[0]["data"]["kvstore.yaml"])
    cfg_path = tmp_path / "kvstore.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    argv = [str(cfg_path) if a == "/etc/tierkv/config/kvstore.yaml" else a for a in argv]
    if "--credentials-file" in argv:  # the credentials file as projected, with stand-in tokens
        i = argv.index("--credentials-file") + 1
        argv[i] = str(k8s_credentials_stand_in(tmp_path / "credentials")[0])
    for i, a in enumerate(argv):  # TLS files are checked for readability: stand-ins for the Secret's
        if a.startswith("/etc/tierkv/tls/"):
            (tmp_path / Path(a).name).write_text("stand-in")
            argv[i] = str(tmp_path / Path(a).name)
    res = check_config(argv, {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"})
    assert res.returncode == 0, f"{kind}: {' '.join(argv)} rejected:\n{res.stderr[-2000:]}"


def _vllm_transfer_config(argv: list[str]) -> dict:
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"], argv  # vLLM's `vllm` CLI may be absent
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def _check_vllm_connector(cfg: dict, address: str, token_file: str) -> None:
    """What vLLM would hand TierKVConnector: the names our docs give, and an extra config our
    connector accepts (parsed by its own config class, as at vLLM's start-up)."""
    from connector.vllm.config import VLLMConnectorConfig

    assert (cfg["kv_connector"], cfg["kv_connector_module_path"]) == ("TierKVConnector", "connector.vllm")
    assert cfg["kv_role"] == "kv_both" and cfg["kv_load_failure_policy"] == "recompute"
    parsed = VLLMConnectorConfig.from_extra(cfg["kv_connector_extra_config"])
    assert parsed.kvstore == address and parsed.token_file == token_file and parsed.tenant  # tests/deploy/test_auth_deploy.py


def test_compose_vllm_uses_the_daemon_through_our_connector() -> None:
    svc = COMPOSE["services"]["vllm"]
    assert svc["depends_on"]["kvstore"]["condition"] == "service_healthy"
    _check_vllm_connector(_vllm_transfer_config(svc["command"]), "kvstore:50051", "/run/secrets/tierkv_token_gamma")
    assert svc["environment"]["HF_HUB_OFFLINE"] == "1"


def test_k8s_vllm_finds_node_local_daemon() -> None:
    (dep,) = manifests("Deployment", "tierkv-vllm")
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    cfg = _vllm_transfer_config(c["command"])
    _check_vllm_connector(cfg, "tierkv-kvstore:50051", "/run/tierkv/token")
    _node_local_daemon(cfg["kv_connector_extra_config"]["kvstore"])
    vols = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    sources = {s["secret"]["name"]: s["secret"]["items"] for s in vols[mounts["/run/tierkv"]]["projected"]["sources"]}
    assert sources["tierkv-token-beta"] == [{"key": "token", "path": "token"}]  # its tenant's token only
    assert sources["tierkv-kvstore-tls"] == [{"key": "ca.crt", "path": "ca.crt"}]  # the CA, not the daemon's key
    assert cfg["kv_connector_extra_config"]["tls_ca"] == "/run/tierkv/ca.crt"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] == "/health", probe
