"""docker-compose.yml takes every credential from compose secrets, and the parts that use them work.

No Docker engine runs here, so the shell snippets the compose file gives Redis and SeaweedFS are
run for real with this machine's redis-server and sh, their secret files standing in for
/run/secrets/; the daemon's command goes through our CLI (--check-config).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

from bench.servers import LOOPBACK, free_port
from tests.deploy.support import COMPOSE, ROOT, check_config, compose_daemon_command

SECRET_FLAGS = {"--redis-password-file", "--s3-access-key-id-file", "--s3-secret-access-key-file", "--mac-secret-file"}
SECRETISH = re.compile(r"PASSWORD|SECRET|ACCESS_KEY|TOKEN$", re.I)


def _unescape(text: str) -> str:
    """What the container's shell gets: compose turns ``$$`` into ``$``."""
    return text.replace("$$", "$")


def _stand_ins(tmp: Path, text: str) -> str:
    """``text`` with each /run/secrets/NAME replaced by a file under ``tmp`` holding a value for NAME
    (made on first use)."""
    values = {"redis_password": "pw" + os.urandom(8).hex(), "s3_access_key_id": "id" + os.urandom(4).hex(),
              "s3_secret_access_key": "sk" + os.urandom(8).hex(), "mac_secret": os.urandom(32).hex()}  # fmt: skip
    for name, value in values.items():
        if not (tmp / name).exists():
            (tmp / name).write_text(value)
    return text.replace("/run/secrets/", f"{tmp}/")


def test_every_credential_is_a_compose_secret_never_a_value() -> None:
    declared = COMPOSE["secrets"]
    for name, spec in declared.items():
        assert spec["file"].startswith("./secrets/"), name  # made by scripts/compose-secrets.sh, ignored by git
    for name, svc in COMPOSE["services"].items():
        for var, value in (svc.get("environment") or {}).items():
            assert not SECRETISH.search(var) or str(value).startswith("/"), f"{name}: {var} is a value, not a file"
        text = json.dumps(svc)
        for path in re.findall(r"/run/secrets/(\w+)", text):
            assert path in svc.get("secrets", []) and path in declared, f"{name} reads {path} without the secret"
    kv = COMPOSE["services"]["kvstore"]
    cmd = kv["command"]
    for flag in SECRET_FLAGS:
        assert cmd[cmd.index(flag) + 1].startswith("/run/secrets/"), flag
    assert not any("@" in str(a) for a in cmd), "a URL with credentials on the command line"
    assert "s3_access_key_id" in COMPOSE["services"]["s3"]["secrets"]
    assert "/secrets/" in (ROOT / ".gitignore").read_text().split()


def test_daemon_command_signs_with_the_mac_secret(tmp_path: Path) -> None:
    res = check_config(*compose_daemon_command(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "blocks signed with the secret in /run/secrets/mac_secret" in res.stdout
    assert "redis: password from /run/secrets/redis_password" in res.stdout


@pytest.mark.skipif(shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
                    reason="needs redis-server and redis-cli")  # fmt: skip
def test_compose_redis_requires_the_password_from_its_secret(tmp_path: Path) -> None:
    svc = COMPOSE["services"]["redis"]
    assert svc["command"][:2] == ["sh", "-c"] and "redis_password" in svc["secrets"]
    port = free_port()
    script = _stand_ins(tmp_path, _unescape(svc["command"][2]))
    script = script.replace("redis-server -", f"redis-server - --port {port} --bind {LOOPBACK} --dir {tmp_path}", 1)
    password = (tmp_path / "redis_password").read_text()
    cli = ["redis-cli", "-h", LOOPBACK, "-p", str(port)]
    proc = subprocess.Popen(["sh", "-c", script], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        authed = ""
        for _ in range(200):  # until it answers (the password given on the command line of this test only)
            assert proc.poll() is None, "redis-server exited"
            authed = subprocess.run([*cli, "--no-auth-warning", "-a", password, "ping"], capture_output=True,
                                    text=True, timeout=30).stdout  # fmt: skip
            if "PONG" in authed:
                break
            time.sleep(0.05)
        assert "PONG" in authed
        anonymous = subprocess.run([*cli, "ping"], capture_output=True, text=True, timeout=30)
        assert "NOAUTH" in anonymous.stdout + anonymous.stderr, "redis answers without the password"
        args = subprocess.run(["ps", "-ww", "-o", "args=", "--ppid", str(proc.pid), "-p", str(proc.pid)],
                              capture_output=True, text=True).stdout  # fmt: skip
        assert "redis-server" in args and password not in args  # not on its command line
        health = svc["healthcheck"]["test"]
        assert health[0] == "CMD-SHELL"
        check = _stand_ins(tmp_path, _unescape(health[1])).replace("redis-cli", " ".join(cli))
        assert subprocess.run(["sh", "-c", check], timeout=30).returncode == 0, "the health check fails"
        wrong = check.replace(str(tmp_path / "redis_password"), str(tmp_path / "mac_secret"))
        assert subprocess.run(["sh", "-c", wrong], timeout=30).returncode != 0, "the health check cannot fail"
    finally:
        proc.terminate()
        proc.wait(10)


def test_compose_s3_identity_is_made_from_its_secrets(tmp_path: Path) -> None:
    svc = COMPOSE["services"]["s3"]
    assert svc["entrypoint"] == ["/bin/sh", "-c"]
    script = _stand_ins(tmp_path, _unescape(svc["command"][0])).replace("/tmp/s3.json", str(tmp_path / "s3.json"))
    script = script.replace("exec weed ", ": weed ")  # everything but starting SeaweedFS
    assert "-s3.config=" in script and subprocess.run(["sh", "-c", script], timeout=30).returncode == 0
    made = json.loads((tmp_path / "s3.json").read_text())
    (ident,) = made["identities"]
    assert ident["credentials"] == [{"accessKey": (tmp_path / "s3_access_key_id").read_text(),
                                     "secretKey": (tmp_path / "s3_secret_access_key").read_text()}]  # fmt: skip
    assert stat.S_IMODE((tmp_path / "s3.json").stat().st_mode) == 0o600


def test_compose_secrets_script_makes_each_file_once(tmp_path: Path) -> None:
    out = tmp_path / "secrets"
    script = str(ROOT / "scripts" / "compose-secrets.sh")
    subprocess.run([script, str(out)], check=True, capture_output=True, timeout=30)
    names = {Path(spec["file"]).name for spec in COMPOSE["secrets"].values()}
    assert {p.name for p in out.iterdir()} == names
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert len((out / "mac_secret").read_text()) >= 32 and len((out / "redis_password").read_text()) >= 32
    before = {p.name: p.read_text() for p in out.iterdir()}
    subprocess.run([script, str(out)], check=True, capture_output=True, timeout=30)
    assert {p.name: p.read_text() for p in out.iterdir()} == before  # never overwritten
