"""Shared pytest set-up. Fixtures live in topic modules registered here as plugins."""

pytest_plugins = ["tests.fixtures_servers", "tests.fixtures_model"]
