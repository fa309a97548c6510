"""A real daemon over a real Redis and a real SeaweedFS: a block someone wrote straight into the
server (a valid checksum, no MAC) is found by a Lookup but never served by a Get, is deleted, and
shows on /metrics; the daemon's own blocks round-trip through the shared tier. And a daemon given
an unreadable or short MAC secret refuses to start, in one line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest

from bench.servers import S3Endpoint, free_port, running_daemon
from kvstore.block import encode_block
from tests.fixtures_kvstore import connect, fetch_one
from tests.fixtures_servers import TEST_BUCKET

pytestmark = pytest.mark.timeout(240)


def _block(key: bytes, fill: int) -> bytes:
    return encode_block(key, np.full(64 * 1024, fill, dtype=np.float32))  # 256 KiB: 8 overflow a 1 MiB cpu tier


@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_daemon_never_serves_a_block_written_around_it(kind: str, tmp_path: Path,
                                                       request: pytest.FixtureRequest) -> None:  # fmt: skip
    tag = uuid.uuid4().hex[:8].encode()
    own = [(k, _block(k, i)) for i, k in enumerate(b"%s-own-%03d" % (tag, i) for i in range(8))]
    forged_key = b"%s-forged" % tag
    secret = tmp_path / "mac.secret"
    secret.write_text("m" * 43)
    port = free_port()
    flags = ["--cpu", "1MiB", "--metrics-port", str(port), "--mac-secret-file", str(secret)]
    env: dict[str, str] = {}
    if kind == "redis":
        import redis

        url = request.getfixturevalue("redis_url")
        flags += ["--redis", url]
        plain = redis.Redis.from_url(url)
        raw_set = lambda k, v: plain.set(b"tierkv:" + k, v)  # noqa: E731
        held = lambda k: bool(plain.exists(b"tierkv:" + k))  # noqa: E731
    else:
        import boto3

        ep: S3Endpoint = request.getfixturevalue("s3_endpoint")
        prefix = f"daemon-{tag.decode()}/"
        flags += ["--s3", f"s3://{TEST_BUCKET}/{prefix}", "--s3-endpoint", ep.url]
        env = {"AWS_ACCESS_KEY_ID": ep.access_key, "AWS_SECRET_ACCESS_KEY": ep.secret_key}
        plain = boto3.client("s3", endpoint_url=ep.url, aws_access_key_id=ep.access_key,
                             aws_secret_access_key=ep.secret_key, region_name=ep.region)  # fmt: skip
        raw_set = lambda k, v: plain.put_object(Bucket=TEST_BUCKET, Key=prefix + k.hex(), Body=v)  # noqa: E731
        held = lambda k: plain.list_objects_v2(Bucket=TEST_BUCKET, Prefix=prefix + k.hex()).get("KeyCount", 0) > 0  # noqa: E731
    raw_set(forged_key, _block(forged_key, 7))
    with running_daemon(tmp_path, *flags, env=env, log_path=tmp_path / "daemon.log") as address, \
            connect(address, deadline_s=30) as c:  # fmt: skip
        assert c.put_many(own) == [True] * len(own)
        deadline = time.monotonic() + 60
        while c.stats().pending_blocks and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.lookup([own[0][0]]).tiers == [kind]  # evicted from the 1 MiB cpu tier
        assert fetch_one(c, own[0][0]) == own[0][1]  # the daemon's own block, through the shared tier
        assert c.lookup([forged_key]).tiers == [kind]  # the forged one is there ...
        assert fetch_one(c, forged_key) is None  # ... and never served
        assert not held(forged_key)
        scrape = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert f'tierkv_tier_corrupt_blocks_total{{reason="unsigned",tier="{kind}"}} 1.0' in scrape
        c.delete([k for k, _ in own])


def _env(cache_dir: Path) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TIERKV_", "AWS_"))}
    return {**base, "TIERKV_CACHE_DIR": str(cache_dir)}


@pytest.mark.parametrize("content,says", [(None, "cannot read"), ("short-secret", "at least 32")])
def test_daemon_refuses_an_unreadable_or_short_secret_in_one_line(tmp_path: Path, content: str | None,
                                                                 says: str) -> None:  # fmt: skip
    secret = tmp_path / "mac.secret"
    if content is not None:
        secret.write_text(content)
    res = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--cpu", "1Mi", "--listen", "127.0.0.1:0",
                          "--redis", f"redis://127.0.0.1:{free_port()}/0", "--mac-secret-file", str(secret)],
                         capture_output=True, text=True, timeout=120, env=_env(tmp_path))
    errors = [line for line in res.stderr.splitlines() if line.startswith("kvstore:")]
    assert res.returncode == 2 and len(errors) == 1 and says in errors[0] and str(secret) in errors[0], res.stderr
    assert "Traceback" not in res.stderr and "short-secret" not in res.stderr
    assert content is not None or not secret.exists()  # a file named explicitly is never made up
