"""deploy/k8s/ as a security reviewer reads it: credentials only from Secrets, TLS to the daemon and
from it to Redis and S3, no port on the node, /metrics on the pod IP behind a NetworkPolicy, a
non-root daemon that can write its hostPath, requests and limits everywhere. The probe the
manifest gives the daemon is run against a real TLS daemon with a certificate made as documented.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvstore.cli import main as kvstore_cli
from kvstore.config.store_config import StoreConfig, TierConfig
from kvstore.server.daemon import Daemon
from tests.deploy.support import K8S, ROOT, manifests
from tiers.redact import redact_url

SECRETISH = re.compile(r"PASSWORD|SECRET|ACCESS_KEY|TOKEN$", re.I)


def _daemon() -> tuple[dict, dict, dict]:
    (ds,) = manifests("DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    return ds, spec, c


def _workloads() -> list[dict]:
    return manifests("DaemonSet") + manifests("Deployment")


def _mounted_secret(spec: dict, container: dict, path: str) -> str:
    """The Secret a file path in ``container`` comes from (AssertionError if from none)."""
    vols = {v["name"]: v for v in spec["volumes"]}
    for m in container["volumeMounts"]:
        if path.startswith(m["mountPath"].rstrip("/") + "/"):
            return vols[m["name"]]["secret"]["secretName"]
    raise AssertionError(f"{path} is on no mounted volume")


def _cm() -> dict:
    return yaml.safe_load(manifests("ConfigMap")[0]["data"]["kvstore.yaml"])


def test_credentials_come_from_secrets_only() -> None:
    for obj in _workloads():
        for c in obj["spec"]["template"]["spec"]["containers"]:
            for e in c.get("env", []):
                if SECRETISH.search(e["name"]):
                    assert "secretKeyRef" in e.get("valueFrom", {}), f"{obj['metadata']['name']}: {e['name']} inline"
    _, spec, c = _daemon()
    cm = _cm()
    assert _mounted_secret(spec, c, cm["mac_secret_file"]) == "tierkv-shared-tiers"  # one Secret: every daemon
    tiers = {t["kind"]: t for t in cm["tiers"]}
    assert redact_url(tiers["redis"]["url"]) == tiers["redis"]["url"], "a password in the redis url"
    assert _mounted_secret(spec, c, tiers["redis"]["password_file"]) == "tierkv-shared-tiers"
    assert not {"access_key_id", "secret_access_key"} & set(tiers["s3"])


def test_tls_to_the_daemon_and_to_the_shared_tiers() -> None:
    _, spec, c = _daemon()
    cmd = c["command"]
    for flag in ("--tls-cert", "--tls-key"):
        assert _mounted_secret(spec, c, cmd[cmd.index(flag) + 1]) == "tierkv-kvstore-tls"
    # the raw Get channel: on (TLS, as gRPC is), on a fixed port the Service and the NetworkPolicy
    # expose under the same number (the client dials the port OpenStream names)
    assert "--no-stream" not in cmd
    port = int(cmd[cmd.index("--stream-port") + 1])
    assert {"name": "stream", "containerPort": port} in c["ports"]
    (svc,) = manifests("Service", "tierkv-kvstore")
    assert {"name": "stream", "port": port, "targetPort": "stream"} in svc["spec"]["ports"]
    (netpol,) = manifests("NetworkPolicy", "tierkv-kvstore")
    assert any({"port": port, "protocol": "TCP"} in rule["ports"] for rule in netpol["spec"]["ingress"])
    tiers = {t["kind"]: t for t in _cm()["tiers"]}
    assert tiers["redis"]["url"].startswith("rediss://") and tiers["s3"]["endpoint"].startswith("https://")
    for kind in ("redis", "s3"):
        assert _mounted_secret(spec, c, tiers[kind]["tls_ca"]) == "tierkv-shared-tiers"
    (engine,) = manifests("Deployment", "tierkv-engine")
    espec = engine["spec"]["template"]["spec"]
    (ec,) = espec["containers"]
    ca = {e["name"]: e.get("value") for e in ec["env"]}["TIERKV_TLS_CA"]
    assert _mounted_secret(espec, ec, ca) == "tierkv-kvstore-tls"
    (vol,) = [v for v in espec["volumes"] if v.get("secret", {}).get("secretName") == "tierkv-kvstore-tls"]
    assert vol["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}], "engines get the CA, never the key"


def test_nothing_listens_on_the_node() -> None:
    for docs in K8S.values():
        for d in docs:
            for c in (d or {}).get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                assert not any("hostPort" in p for p in c.get("ports", [])), d["metadata"]["name"]
            assert not (d or {}).get("spec", {}).get("template", {}).get("spec", {}).get("hostNetwork")


def test_metrics_on_the_pod_ip_behind_a_network_policy() -> None:
    ds, _, c = _daemon()
    cmd = c["command"]
    listen = cmd[cmd.index("--metrics-listen") + 1]
    var, port = re.fullmatch(r"\$\((\w+)\):(\d+)", listen).groups()
    assert {e["name"]: e for e in c["env"]}[var]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    (policy,) = manifests("NetworkPolicy")
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert "Ingress" in policy["spec"]["policyTypes"]
    allowed: dict[int, list[dict]] = {}
    for rule in policy["spec"]["ingress"]:
        assert rule.get("from"), "a rule open to every source"
        for p in rule["ports"]:
            allowed.setdefault(int(p["port"]), []).extend(rule["from"])
    assert set(allowed) == {50051, 50052, int(port)}  # gRPC, the raw Get channel, /metrics
    assert allowed[50052] == allowed[50051]  # the same clients on both daemon ports
    clients = {tuple(sorted(f["podSelector"]["matchLabels"].items())) for f in allowed[50051]}
    for name in ("tierkv-engine", "tierkv-vllm"):
        (dep,) = manifests("Deployment", name)
        assert any(set(sel) <= set(dep["spec"]["template"]["metadata"]["labels"].items()) for sel in clients), name
    for f in allowed[int(port)]:  # only Prometheus: no engine (or anything else) scrapes or reads /dashboard
        assert f.get("podSelector", {}).get("matchLabels") and f["podSelector"]["matchLabels"].get(
            "app.kubernetes.io/name") not in ("tierkv-engine", "tierkv-vllm")


def _dockerfile_uid() -> int:
    user = [ln.split()[1] for ln in (ROOT / "Dockerfile").read_text().splitlines() if ln.startswith("USER ")][-1]
    return int(user.split(":")[0])


def test_daemon_runs_as_the_images_non_root_user_and_owns_its_hostpath() -> None:
    uid = _dockerfile_uid()
    _, spec, c = _daemon()
    ctx = spec["securityContext"]
    assert uid != 0 and ctx["runAsNonRoot"] is True and ctx["runAsUser"] == uid and ctx["fsGroup"]
    assert c.get("securityContext", {}).get("runAsUser", uid) == uid
    vols = {v["name"]: v for v in spec["volumes"]}
    written = [m for m in c["volumeMounts"] if "hostPath" in vols[m["name"]] and m["mountPath"] != "/dev/shm"
               and not m.get("readOnly")]  # fmt: skip
    assert written, "the disk tier's hostPath"
    for m in written:  # fsGroup does not apply to a hostPath: an init step hands it to the daemon's user
        inits = [i for i in spec["initContainers"]
                 if any(im["name"] == m["name"] for im in i["volumeMounts"])]  # fmt: skip
        assert any(f"chown -R {uid}:{uid} {m['mountPath']}" in " ".join(i["command"]) for i in inits), m
        for i in inits:
            assert "CHOWN" in i["securityContext"]["capabilities"]["add"]
            assert i["securityContext"]["capabilities"]["drop"] == ["ALL"]
    (engine,) = manifests("Deployment", "tierkv-engine")
    assert engine["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == uid  # shared memory: one user


def test_every_container_has_requests_and_limits() -> None:
    for obj in _workloads():
        spec = obj["spec"]["template"]["spec"]
        for c in spec["containers"] + spec.get("initContainers", []):
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), f"{obj['metadata']['name']}/{c['name']} {kind}"


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_the_manifests_probe_passes_against_a_tls_daemon(tmp_path: Path) -> None:
    """The certificate as docs/operations.md makes it (names tierkv-kvstore and localhost), the
    daemon serving TLS, and the probe command of the manifest: SERVING, exit 0."""
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.crt",
                 "-days", "1", "-subj", f"/CN=tierkv-{ca}", cwd=tmp_path)  # fmt: skip
    (tmp_path / "san.ext").write_text("subjectAltName=DNS:tierkv-kvstore,DNS:localhost\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr", "-subj",
             "/CN=tierkv-kvstore", cwd=tmp_path)  # fmt: skip
    _openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
             "tls.crt", "-days", "1", "-extfile", "san.ext", cwd=tmp_path)  # fmt: skip
    _, _, c = _daemon()
    probe = c["livenessProbe"]["exec"]["command"]
    assert probe == c["readinessProbe"]["exec"]["command"] == c["startupProbe"]["exec"]["command"]
    cfg = StoreConfig(tiers=(TierConfig("cpu", 16 << 20),), listen="127.0.0.1:0", token="t" * 32,
                      tls_cert=str(tmp_path / "tls.crt"), tls_key=str(tmp_path / "tls.key"))  # fmt: skip
    daemon = Daemon(cfg)
    daemon.start()
    try:
        argv = [a.replace(":50051", f":{daemon.port}").replace("/etc/tierkv/tls/", f"{tmp_path}/") for a in probe]
        assert argv[0] == "kvstore" and kvstore_cli(argv[1:]) == 0
        wrong_ca = [a.replace(f"{tmp_path}/ca.crt", f"{tmp_path}/other-ca.crt") for a in argv]  # it can fail
        assert kvstore_cli(wrong_ca[1:]) != 0
    finally:
        daemon.stop()
