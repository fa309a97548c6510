"""Redis over TLS: a real redis-server serving only TLS (and requiring a password), reached with
``rediss://``, ``--redis-tls-ca`` and ``--redis-password-file``; a CA that did not sign the
server's certificate is refused (the tier starts detached, nothing is written in plaintext).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from bench.servers import LOOPBACK, free_port
from kvstore.block import encode_block
from kvstore.config.store_config import load_config
from kvstore.store.tier_factory import build_store

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not (shutil.which("openssl") and shutil.which("redis-server")
                                      and shutil.which("redis-cli")), reason="needs openssl and redis")]  # fmt: skip
PASSWORD = "tls-pw-" + "4" * 20


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _pki(d: Path) -> None:
    for ca in ("ca", "other-ca"):
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.crt",
                 "-days", "1", "-subj", f"/CN={ca}", cwd=d)  # fmt: skip
    (d / "san.ext").write_text(f"subjectAltName=IP:{LOOPBACK}\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "redis.key", "-out", "redis.csr", "-subj",
             "/CN=redis", cwd=d)  # fmt: skip
    _openssl("x509", "-req", "-in", "redis.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
             "redis.crt", "-days", "1", "-extfile", "san.ext", cwd=d)  # fmt: skip


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, Path]]:
    _pki(tmp_path)
    port = free_port()
    argv = ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", LOOPBACK, "--dir", str(tmp_path),
            "--tls-cert-file", "redis.crt", "--tls-key-file", "redis.key", "--tls-ca-cert-file", "ca.crt",
            "--tls-auth-clients", "no", "--requirepass", PASSWORD, "--save", "", "--appendonly", "no"]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ping = ["redis-cli", "--tls", "--cacert", str(tmp_path / "ca.crt"), "-h", LOOPBACK, "-p", str(port),
            "--no-auth-warning", "-a", PASSWORD, "ping"]  # fmt: skip
    try:
        for _ in range(200):
            if proc.poll() is not None:
                pytest.skip("this redis-server has no TLS support")
            if "PONG" in subprocess.run(ping, capture_output=True, text=True, timeout=30).stdout:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("redis-server with TLS did not answer")
        yield port, tmp_path
    finally:
        proc.terminate()
        proc.wait(10)


def _flags(port: int, d: Path, ca: str) -> list[str]:
    (d / "pw").write_text(PASSWORD + "\n")
    (d / "mac").write_text("m" * 40)
    return ["--cpu", "1MiB", "--redis", f"rediss://{LOOPBACK}:{port}/0", "--redis-tls-ca", str(d / ca),
            "--redis-password-file", str(d / "pw"), "--mac-secret-file", str(d / "mac")]


def test_blocks_round_trip_over_tls_checked_against_the_ca(tls_redis: tuple[int, Path]) -> None:
    port, d = tls_redis
    store = build_store(load_config(_flags(port, d, "ca.crt"), env={}))
    keys = [b"tls-%012d" % i for i in range(8)]
    try:
        assert store.stats().tiers[1].available
        for i, k in enumerate(keys):  # 256 KiB blocks through a 1 MiB cpu tier: the rest from redis
            assert store.put(k, encode_block(k, np.full(64 * 1024, i, np.float32)))
        assert store.flush(timeout=60)
        assert [store.get(k) for k in keys] == [encode_block(k, np.full(64 * 1024, i, np.float32))
                                                for i, k in enumerate(keys)]  # fmt: skip
        assert store.stats().tiers[1].hits > 0
    finally:
        store.close()


def test_a_server_certificate_the_ca_did_not_sign_is_refused(tls_redis: tuple[int, Path]) -> None:
    port, d = tls_redis
    store = build_store(load_config(_flags(port, d, "other-ca.crt"), env={}))
    try:
        redis_tier = store.stats().tiers[1]
        assert not redis_tier.available and "certificate verify failed" in redis_tier.last_error.lower()
    finally:
        store.close()
