"""Shared pytest set-up. Fixtures live in topic modules registered here as plugins."""

pytest_plugins = ["tests.fixtures_servers", "tests.fixtures_model"]


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
