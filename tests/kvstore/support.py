"""What kvstore tests share beyond tests/fixtures_kvstore.py (no tests here): the auth tests' token
and block, the trace tests' block."""

from __future__ import annotations

import numpy as np

from kvstore.block import encode_block

TOKEN = "s3cret-token-for-tests-0123456789"
WRONG = "not-the-token-but-long-enough-000"
KEY = b"auth-key-0000001"


def auth_block(key: bytes = KEY) -> bytes:
    return encode_block(key, np.arange(256, dtype="f4"), layout="T")


def blk(key: bytes, n: int = 1000) -> bytes:
    return encode_block(key, np.zeros(n, dtype=np.uint8))
