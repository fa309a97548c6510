"""Sizes the Kubernetes way (kvstore/config/sizes.py, and engine/env.py's copy held to the same table):
G = 10^9, Gi = 2^30, bare numbers are bytes, and the ambiguous lowercase spellings refused with both
readings spelled out."""

from __future__ import annotations

import pytest

from engine.env import parse_size as engine_parse_size
from engine.errors import ConfigError as EngineConfigError
from kvstore.config.sizes import SizeError, format_size, parse_size
from tiers.errors import ConfigError


@pytest.mark.parametrize("text,expected", [
    ("100", 100), ("100B", 100), ("0", 0),
    ("1k", 10**3), ("1K", 10**3), ("1kB", 10**3), ("1KB", 10**3),
    ("512M", 512 * 10**6), ("4G", 4 * 10**9), ("4GB", 4 * 10**9), ("2T", 2 * 10**12), ("1P", 10**15), ("1E", 10**18),
    ("1Ki", 1024), ("1KiB", 1024), ("512Mi", 512 << 20), ("4Gi", 4 << 30), ("4GiB", 4 << 30), ("4 GiB", 4 << 30),
    ("1Ti", 1 << 40), ("1Ei", 1 << 60),
    ("1.5Gi", 3 << 29), ("1.5GB", 1_500_000_000), (".5Ki", 512),
    ("0.1Ki", 103),  # 102.4 rounded up to a whole byte, as Kubernetes does
])  # fmt: skip
def test_kubernetes_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected
    assert engine_parse_size(text) == expected  # the engine's flags and TIERKV_ENGINE_* read sizes the same way


@pytest.mark.parametrize("text,readings", [
    ("4gb", ("4G or 4GB for 4x10^9", "4Gi or 4GiB for 4x2^30")),
    ("4g", ("4G or 4GB", "4Gi or 4GiB")),
    ("512m", ("512M or 512MB for 512x10^6", "512Mi or 512MiB for 512x2^20")),  # Kubernetes: milli-bytes
    ("4gib", ("4G or 4GB", "4Gi or 4GiB")),
    ("4Gb", ("4G or 4GB", "4Gi or 4GiB")),  # gigabits
    ("1kb", ("1K or 1KB", "1Ki or 1KiB")),
])  # fmt: skip
def test_ambiguous_lowercase_refused_with_both_readings(text: str, readings: tuple[str, str]) -> None:
    with pytest.raises(SizeError) as e:
        parse_size(text)
    assert "case-sensitive" in str(e.value) and all(r in str(e.value) for r in readings), str(e.value)
    with pytest.raises(EngineConfigError) as e2:
        engine_parse_size(text)
    assert all(r in str(e2.value) for r in readings), str(e2.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("bad", ["", "GiB", "4 parsecs", "-1Gi", "1e9", "4.Gi", "four", "4Gi4", True, -5])
def test_not_a_size(bad: object) -> None:
    with pytest.raises(SizeError, match="bad size"):
        parse_size(bad)  # type: ignore[arg-type]
    with pytest.raises(EngineConfigError, match="bad size"):
        engine_parse_size(bad)  # type: ignore[arg-type]


def test_errors_are_typed() -> None:
    """A SizeError is the storage side's ConfigError and a ValueError (pydantic reports it per field)."""
    assert issubclass(SizeError, ConfigError) and issubclass(SizeError, ValueError)


def test_format_size() -> None:
    assert format_size(100) == "100 B" and format_size(64 << 20) == "64.0 MiB" and format_size(3 << 29) == "1.5 GiB"
