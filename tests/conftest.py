"""Shared pytest set-up. Fixtures live in topic modules registered here as plugins."""

pytest_plugins = ["tests.fixtures_servers", "tests.fixtures_model", "tests.fixtures_kvstore", "tests.fixtures_engine"]


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA is present (CI machines have none)."""
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_assertrepr_compare(op, left, right):
    """A failing ``==`` on large byte strings is summarised, not diffed: pytest's difflib
    rendering of two 64 KiB blobs takes longer than the test's timeout, hiding the failure."""
    big = (bytes, bytearray, memoryview)
    if op != "==" or not (isinstance(left, big) and isinstance(right, big)):
        return None
    a, b = bytes(left), bytes(right)
    if max(len(a), len(b)) <= 1024:
        return None
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    ndiff = sum(x != y for x, y in zip(a, b, strict=False)) + abs(len(a) - len(b))
    return [
        f"{len(a)} bytes == {len(b)} bytes",
        f"first difference at offset {first}; {ndiff} bytes differ",
        f"left[{first}:{first + 16}]  = {a[first:first + 16]!r}",
        f"right[{first}:{first + 16}] = {b[first:first + 16]!r}",
    ]
