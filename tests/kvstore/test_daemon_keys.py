"""Keys per call are bounded on every path (Lookup, Get, Put, Delete, the raw Get channel).

Why: a 65,536-key Lookup looped over the store's index and asked each shared tier about every
missing key (an S3 HEAD each), all for one call; the bound fits the longest real prompt.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kvstore.errors import InvalidRequest
from tests.fixtures_kvstore import connect, served
from tests.kvstore.limits_support import blk, lookup, settings

pytestmark = pytest.mark.timeout(120)


def test_keys_per_call_are_bounded_on_every_path(tmp_path: Path) -> None:
    with served(tmp_path, "--no-auth", env=settings(max_keys_per_call=8)) as d:
        keys = [b"key-%d" % i for i in range(9)]
        with connect(d, use_shm=False, use_stream=False) as c:
            assert c.lookup(keys[:8]).prefix_len == 0
            for call in (lambda: c.lookup(keys), lambda: c.delete(keys), lambda: c.put_many([(k, blk(k)) for k in keys]),
                         lambda: c.read_batches(keys, lambda items: None)):  # fmt: skip
                with pytest.raises(InvalidRequest, match="^9 keys in one call \\(max 8\\)$"):
                    call()
        with connect(d, use_shm=False, use_stream=True) as c:  # the raw Get channel too
            with pytest.raises(InvalidRequest, match="9 keys in one call \\(max 8\\)"):
                c.read_batches(keys, lambda items: None)


def test_the_default_bound_fits_a_long_prompt_and_refuses_more(tmp_path: Path) -> None:
    with served(tmp_path, "--no-auth") as d:
        assert d.cfg.max_keys_per_call == 4096  # 65,536 tokens at 16 a page
        assert lookup(d.address, [b"%d" % i for i in range(4096)]).prefix_len == 0
        with pytest.raises(grpc.RpcError) as e:
            lookup(d.address, [b"%d" % i for i in range(4097)])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details() == \
            "4097 keys in one call (max 4096)"  # fmt: skip
