"""bench/servers.py ``prepare_bucket`` tries the warm-up write again while SeaweedFS answers 500
InternalError (it does while it grows a new bucket's volumes on a loaded machine: once, in a full
``make test`` on 2 cores), and gives up on any other error at once."""

from __future__ import annotations

import boto3
import pytest
from botocore.exceptions import ClientError

from bench import servers
from bench.servers import S3Endpoint, prepare_bucket

EP = S3Endpoint("http://127.0.0.1:1", "key", "secret", "us-east-1")


class _Client:
    class exceptions:  # noqa: N801 - botocore's shape
        class BucketAlreadyOwnedByYou(Exception):
            pass

    def __init__(self, failures: list[str]) -> None:
        self.failures, self.puts, self.deleted = failures, 0, False

    def create_bucket(self, **_: object) -> None:
        pass

    def put_object(self, **_: object) -> None:
        self.puts += 1
        if self.failures:
            code = self.failures.pop(0)
            raise ClientError({"Error": {"Code": code, "Message": "please try again"}}, "PutObject")

    def delete_object(self, **_: object) -> None:
        self.deleted = True

    def close(self) -> None:
        pass


def _with(monkeypatch: pytest.MonkeyPatch, client: _Client) -> None:
    monkeypatch.setattr(boto3.session.Session, "client", lambda self, *a, **k: client)
    monkeypatch.setattr(servers.time, "sleep", lambda s: None)


def test_an_internal_error_while_volumes_grow_is_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    client = _Client(["InternalError", "InternalError", "InternalError"])
    _with(monkeypatch, client)
    prepare_bucket(EP, "b")
    assert client.puts == 4 and client.deleted


def test_other_errors_and_the_deadline_are_not_waited_out(monkeypatch: pytest.MonkeyPatch) -> None:
    client = _Client(["AccessDenied"])
    _with(monkeypatch, client)
    with pytest.raises(ClientError, match="AccessDenied"):
        prepare_bucket(EP, "b")
    assert client.puts == 1
    client = _Client(["InternalError"] * 3)
    _with(monkeypatch, client)
    with pytest.raises(ClientError, match="InternalError"):
        prepare_bucket(EP, "b", timeout_s=-1)
    assert client.puts == 1
