"""S3 tier: blocks as objects under ``bucket/prefix`` on any S3 endpoint (AWS, SeaweedFS, MinIO).

Why these choices:
- Object names are ``prefix + key.hex()`` so binary keys are safe in URLs and listings, and
  ``scan`` can recover the keys after a restart from the listing alone.
- Small connect/read timeouts and a bounded retry count: a dead or hung endpoint must surface as
  TierUnavailable within seconds so the store can fall through, never freeze the engine.
  ``connect=False`` builds the client without a request (the daemon starts while S3 is down;
  ``probe`` checks it later).
- Checksums only when the API requires them: blocks carry their own checksum (block format), so
  hashing every multi-MB body again on both sides would only cost bandwidth.
- ``contains_many`` (the store's lookup) asks in parallel, one HEAD per key on a small pool.
- Refused credentials are TierAuthError ("authentication failed"); the secret key lives only in
  the boto3 client, never in a message or repr.
- Budget: a bucket shared by several nodes is bounded by its own lifecycle rule (expire objects
  under the prefix after N days); see kvstore/README.md, "Shared tiers".
- ``max_value_bytes``: ``get`` looks at the object's ContentLength before reading its body, and a
  longer object is refused (StoredValueTooLarge) with its body never read (a response without a
  length is read to one byte past the limit at most): anyone who can write to the bucket chooses
  what is stored there. ``ca_bundle``: the CA file of an https endpoint.
"""

from __future__ import annotations

import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import boto3
import botocore.config
import botocore.exceptions as bce

from tiers.base import Buffer, Tier
from tiers.errors import BlockTooLarge, StoredValueTooLarge, TierAuthError, TierError, TierUnavailable
from tiers.reach import any_reachable

_UNREACHABLE = (
    bce.EndpointConnectionError,
    bce.ConnectTimeoutError,
    bce.ReadTimeoutError,
    bce.ConnectionClosedError,
    bce.HTTPClientError,
)
_T = TypeVar("_T")
_R = TypeVar("_R")
_MISSING = {"404", "NoSuchKey", "NotFound", "NoSuchBucket"}
_DENIED = {"403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken"}


def client_config(connect_timeout_s: float = 1.0, read_timeout_s: float = 3.0, max_attempts: int = 2,
                  workers: int = 8) -> botocore.config.Config:
    """The botocore settings of the tier: bounded timeouts and retries, a connection per worker,
    path-style addressing (SeaweedFS, MinIO), checksums only where S3 requires them."""
    return botocore.config.Config(
        connect_timeout=connect_timeout_s,
        read_timeout=read_timeout_s,
        retries={"total_max_attempts": max_attempts, "mode": "standard"},
        max_pool_connections=max(10, workers * 2),
        s3={"addressing_style": "path"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )


class S3Tier(Tier):
    name = "s3"
    persistent = True

    def __init__(
        self,
        endpoint_url: str | None,
        bucket: str,
        capacity_bytes: int,
        *,
        prefix: str = "",
        access_key: str | None = None,
        secret_key: str | None = None,
        region: str = "us-east-1",
        connect_timeout_s: float = 1.0,
        read_timeout_s: float = 3.0,
        max_attempts: int = 2,
        workers: int = 8,
        create_bucket: bool = True,
        connect: bool = True,
        ca_bundle: str | None = None,
        max_value_bytes: int | None = None,
    ) -> None:
        super().__init__(capacity_bytes)
        if max_value_bytes is not None and max_value_bytes <= 0:
            raise ValueError(f"s3: max_value_bytes must be > 0, got {max_value_bytes}")
        self.bucket, self.prefix, self.max_value_bytes = bucket, prefix, max_value_bytes
        cfg = client_config(connect_timeout_s, read_timeout_s, max_attempts, workers)
        self._client = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url,
            aws_access_key_id=access_key,
            aws_secret_access_key=secret_key,
            region_name=region,
            config=cfg,
            verify=ca_bundle or None,  # None: botocore's default bundle (or AWS_CA_BUNDLE)
        )
        self._workers = workers
        self._connect_timeout_s = connect_timeout_s
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._create_bucket = create_bucket
        if create_bucket and connect:
            self._ensure_bucket()

    # -- helpers --------------------------------------------------------------
    def __repr__(self) -> str:
        return f"S3Tier(bucket={self.bucket!r}, prefix={self.prefix!r}, capacity_bytes={self.capacity_bytes})"

    def _call(self, what: str, fn: Callable[..., Any], /, **kw: Any) -> Any:
        """Run one client call, mapping botocore failures onto the tier's error types.

        A ClientError is re-raised as is (callers tell "missing" apart), except a refusal of
        our credentials, which is TierAuthError.
        """
        if self._closed:
            raise TierError(self.name, "tier is closed")
        try:
            return fn(**kw)
        except bce.ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            if code in _DENIED:
                raise TierAuthError(self.name, f"{what} {self.bucket}: authentication failed ({code})") from e
            raise
        except bce.NoCredentialsError as e:
            raise TierAuthError(self.name, f"{what}: authentication failed (no credentials)") from e
        except _UNREACHABLE as e:
            raise TierUnavailable(self.name, f"{what}: endpoint unreachable: {e}") from e
        except bce.BotoCoreError as e:
            raise TierError(self.name, f"{what}: {e}") from e

    def _ensure_bucket(self) -> None:
        try:
            self._call("head_bucket", self._client.head_bucket, Bucket=self.bucket)
        except bce.ClientError as e:
            if e.response.get("Error", {}).get("Code") not in _MISSING:
                raise TierError(self.name, f"bucket {self.bucket}: {e}") from e
            try:
                self._call("create_bucket", self._client.create_bucket, Bucket=self.bucket)
            except bce.ClientError as e2:
                code = e2.response.get("Error", {}).get("Code")
                if code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise TierError(self.name, f"cannot create bucket {self.bucket}: {e2}") from e2

    def _obj(self, key: bytes) -> str:
        return self.prefix + bytes(key).hex()

    def _map_pool(self, fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
        if len(items) <= 1:
            return [fn(x) for x in items]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="s3tier")
        return list(self._pool.map(fn, items))

    def _list(self) -> Iterator[tuple[bytes, int]]:
        token: str | None = None
        while True:
            kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix, "MaxKeys": 1000}
            if token:
                kw["ContinuationToken"] = token
            try:
                page = self._call("list", self._client.list_objects_v2, **kw)
            except bce.ClientError as e:
                raise TierError(self.name, f"list {self.bucket}/{self.prefix}: {e}") from e
            for obj in page.get("Contents", []):
                name = obj["Key"][len(self.prefix) :]
                try:
                    yield bytes.fromhex(name), int(obj["Size"])
                except ValueError:
                    continue  # not one of ours
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    # -- Tier interface -------------------------------------------------------
    def put(self, key: bytes, value: Buffer) -> None:
        body = value if isinstance(value, bytes) else bytes(memoryview(value).cast("B"))
        if len(body) > self.capacity_bytes:
            raise BlockTooLarge(f"[s3] block of {len(body)} bytes exceeds capacity {self.capacity_bytes}")
        try:
            self._call("put", self._client.put_object, Bucket=self.bucket, Key=self._obj(key), Body=body)
        except bce.ClientError as e:
            raise TierError(self.name, f"put: {e}") from e

    def get(self, key: bytes) -> bytes | None:
        try:
            resp = self._call("get", self._client.get_object, Bucket=self.bucket, Key=self._obj(key))
            return self._read_body(key, resp)
        except bce.ClientError as e:
            if e.response.get("Error", {}).get("Code") in _MISSING:
                return None
            raise TierError(self.name, f"get: {e}") from e
        except (bce.ReadTimeoutError, bce.ResponseStreamingError, OSError) as e:
            raise TierUnavailable(self.name, f"get: body read failed: {e}") from e

    def _read_body(self, key: bytes, resp: dict[str, Any]) -> bytes:
        body, limit, size = resp["Body"], self.max_value_bytes, resp.get("ContentLength")
        if limit is None or (size is not None and size <= limit):
            return body.read()  # botocore checks the body against ContentLength
        if size is None:  # no length given: read one byte past the limit at most
            data = body.read(limit + 1)
            if len(data) <= limit:
                return data
        body.close()  # the rest of the body is never read
        raise StoredValueTooLarge(f"[s3] object of {key.hex()[:16]} is over {limit} bytes: refused")

    def _contains(self, key: bytes) -> bool:
        try:
            self._call("head", self._client.head_object, Bucket=self.bucket, Key=self._obj(key))
            return True
        except bce.ClientError as e:
            if e.response.get("Error", {}).get("Code") in _MISSING:
                return False
            raise TierError(self.name, f"head: {e}") from e

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self._map_pool(self._contains, list(keys))

    def delete(self, key: bytes) -> bool:
        """S3's DELETE does not say whether the object existed, so HEAD first."""
        if not self._contains(key):
            return False
        try:
            self._call("delete", self._client.delete_object, Bucket=self.bucket, Key=self._obj(key))
        except bce.ClientError as e:
            raise TierError(self.name, f"delete: {e}") from e
        return True

    def scan(self) -> Iterator[tuple[bytes, int]]:
        return self._list()

    def probe(self) -> None:
        """HEAD the bucket (creating it when missing, if the tier creates buckets), once a TCP
        connect to the endpoint answers (``_unreachable``)."""
        if (why := self._unreachable()) is not None:
            raise TierUnavailable(self.name, f"probe: endpoint unreachable: {why}")
        if self._create_bucket:
            self._ensure_bucket()
            return
        try:
            self._call("head_bucket", self._client.head_bucket, Bucket=self.bucket)
        except bce.ClientError as e:
            raise TierError(self.name, f"bucket {self.bucket}: {e}") from e

    def _unreachable(self) -> str | None:
        """Why the endpoint cannot be reached now (None: a connect answered, or the endpoint is
        reached through a proxy, which botocore's own call then tries). A detached tier's prober
        calls this first: on a cut link it connects afresh every 0.1 s (tiers/reach.py), so a heal
        is seen within that, where botocore's connect would wait for the kernel's SYN resend (1 s)
        or its own retry."""
        url = urllib.parse.urlsplit(self._client.meta.endpoint_url)
        proxied = urllib.request.getproxies().get(url.scheme) and not urllib.request.proxy_bypass(url.hostname or "")
        if not url.hostname or proxied:
            return None
        port = url.port or (443 if url.scheme == "https" else 80)
        reach = any_reachable([(url.hostname, port)], self._connect_timeout_s)
        if reach.answered:
            return None
        if reach.waited:
            return f"no answer to a connect to {url.hostname}:{port} within {self._connect_timeout_s} s"
        return f"{url.hostname}:{port} refused the connect or has no route"

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._client.close()
