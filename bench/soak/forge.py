"""Forged blocks written straight into Redis and S3, over keys a tenant's next request will read.

One forgery (``Forger.once``): the ``probe`` tenant sends a fresh prompt on replica a (its cold
answer is the reference); its blocks reach the daemon and, written through, Redis. Their keys
are read out of Redis under the tenant's tag (bench/soak/tenant_probes.py ``tenant_keys``); the
admin credential deletes them from every tier of the daemon; then, for each key, a forged block
goes into one shared tier: the real block's header (key, dtype, shape) over other numbers, with
a valid xxh3 checksum (``encode_block``), and a trailer that is

- ``unsigned``: none (what anything but a daemon writes),
- ``mac``: the cluster's secret id with a made-up tag,
- ``unknown_secret``: a real HMAC under a secret the daemons do not hold.

The same tenant then sends the prompt on replica b, which never computed it: the daemon finds the
keys in that tier (Redis: a lookup; S3: the same, Redis holding nothing), and must refuse every
forged block (a miss, deleted, counted in ``tierkv_tier_corrupt_blocks_total``) so the replica
recomputes. Judged by the answer against the reference and by that counter
(bench/soak/security_figures.py ``forged_figures``).
"""

from __future__ import annotations

import os
import time

import boto3
import botocore.config
import grpc
import numpy as np
import redis

from bench.soak.cluster import BUCKET, Cluster
from bench.soak.load import Load, private_prompt
from bench.soak.security_figures import Forgery
from bench.soak.tenancy import PROBE
from bench.soak.tenant_probes import REDIS_PREFIX, WAIT_S, md, tenant_keys
from kvstore.block import decode_block, encode_block
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from tiers.mac import MAGIC, TRAILER_BYTES, BlockMac

S3_PREFIX = "kv/"
KINDS = ("unsigned", "mac", "unknown_secret")
TIERS = ("redis", "s3")


def forge(key: bytes, stored: bytes, kind: str, rng: np.random.Generator) -> bytes:
    """A block under ``key`` shaped as the real one (``stored``: block + trailer) with other
    numbers and a valid checksum, carrying the trailer ``kind`` says."""
    body = stored[:-TRAILER_BYTES] if stored[-TRAILER_BYTES:][: len(MAGIC)] == MAGIC else stored
    blk = decode_block(body)
    arr = blk.array()
    fake = (rng.standard_normal(arr.shape) * (float(np.abs(arr).mean()) + 1.0)).astype(arr.dtype)
    block = encode_block(key, fake, layout=blk.layout)
    if kind == "unsigned":
        return block
    if kind == "mac":
        ident = stored[-TRAILER_BYTES:][len(MAGIC) : len(MAGIC) + 8]  # the cluster's secret id, a made-up tag
        return block + MAGIC + ident + os.urandom(32)
    return BlockMac(os.urandom(32).hex().encode()).seal(key, block)  # signed, by a secret no daemon holds


class Forger:
    def __init__(self, cluster: Cluster, load: Load, words: int, seed: int) -> None:
        self.cluster, self.load, self.words, self.seed = cluster, load, words, seed
        self.forgeries: list[Forgery] = []
        self.rng = np.random.default_rng(seed)
        ep = cluster.s3.endpoint
        self.s3 = boto3.session.Session().client(
            "s3", endpoint_url=ep.url, aws_access_key_id=ep.access_key, aws_secret_access_key=ep.secret_key,
            region_name=ep.region, config=botocore.config.Config(connect_timeout=2, read_timeout=10,
                                                                 retries={"total_max_attempts": 2}))  # fmt: skip

    def once(self, k: int) -> Forgery:
        tier, kind = TIERS[k % len(TIERS)], KINDS[(k // len(TIERS)) % len(KINDS)]
        f = self._once(k, tier, kind)
        self.forgeries.append(f)
        return f

    def _once(self, k: int, tier: str, kind: str) -> Forgery:
        c, reps = self.cluster, self.load.replicas
        p = private_prompt(PROBE, 10_000 + k, self.words, self.seed)
        p = p._replace(pid=f"forge-{k}", messages=[{**p.messages[0], "content": f"Forge target {k}. " +
                                                    p.messages[0]["content"]}, p.messages[1]])  # fmt: skip
        r = redis.Redis.from_url(c.redis.url, socket_timeout=5, socket_connect_timeout=2)
        try:
            before = tenant_keys(c.redis.url, PROBE)
            first = self.load.ask(p, PROBE, reps[0], keep=False)
            ref = first.text if first.error is None and first.cached == 0 else None
            keys = self._written(before)
            stored = {key: r.get(REDIS_PREFIX + key) for key in keys}
            stored = {key: v for key, v in stored.items() if v}
            if not stored:
                return Forgery(tier, kind, 0, ref, None, None, None, "no blocks of the prompt in Redis")
            with grpc.insecure_channel(c.daemon.address) as ch:  # gone from every tier of the daemon
                pb_grpc.KVStoreStub(ch).Delete(pb.DeleteRequest(keys=list(stored)), metadata=md(c.token),
                                               timeout=WAIT_S)  # fmt: skip
            fakes = {key: forge(key, value, kind, self.rng) for key, value in stored.items()}
            for key, fake in fakes.items():
                if tier == "redis":
                    r.set(REDIS_PREFIX + key, fake)
                else:
                    self.s3.put_object(Bucket=BUCKET, Key=S3_PREFIX + key.hex(), Body=fake)
            before_c = c.daemon.corrupt_blocks()
            incarnation = c.daemon.incarnation
            victim = self.load.ask(p, PROBE, reps[1 % len(reps)], keep=False)
            after_c = c.daemon.corrupt_blocks()
            delta = None
            if before_c is not None and after_c is not None and incarnation == c.daemon.incarnation:
                delta = sum(v - before_c.get(lab, 0.0) for lab, v in after_c.items() if lab[0] == tier)
            left = sum(1 for key, fake in fakes.items() if self._stored(r, tier, key) == fake)
            return Forgery(tier, kind, len(stored), ref, victim.text if victim.error is None else None, delta, left,
                           victim.error or "")  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a server down mid-probe: reported as unclear, never raised
            return Forgery(tier, kind, 0, None, None, None, None, f"{type(e).__name__}: {e}"[:200])
        finally:
            r.close()

    def _stored(self, r: redis.Redis, tier: str, key: bytes) -> bytes | None:
        """What the tier holds under ``key`` now (a forged value left there, or a real block written since)."""
        if tier == "redis":
            return r.get(REDIS_PREFIX + key)  # type: ignore[return-value]
        try:
            return self.s3.get_object(Bucket=BUCKET, Key=S3_PREFIX + key.hex())["Body"].read()
        except self.s3.exceptions.NoSuchKey:
            return None

    def _written(self, before: set[bytes], wait_s: float = 10.0) -> list[bytes]:
        """The prompt's keys in Redis once the daemon's queue is empty and they stopped coming (a late
        write-through must not land after the forgery)."""
        deadline = time.monotonic() + wait_s
        last: set[bytes] = set()
        while time.monotonic() < deadline:
            keys = tenant_keys(self.cluster.redis.url, PROBE) - before
            if keys and keys == last and not self.cluster.daemon.queued_bytes():
                break
            last = keys
            time.sleep(0.3)
        return sorted(last)

    def close(self) -> None:
        self.s3.close()
