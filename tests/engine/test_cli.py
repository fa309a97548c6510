"""kvengine's operator surface: --check-config validates flags, the environment of every plug-in the
flags ask for, and exits; a bad value is one line and exit 2, never a traceback (and never after a
model load)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli import host_port
from engine.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def kvengine(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TIERKV_")}
    return subprocess.run([sys.executable, "-m", "engine.cli", *argv], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**base, **env})


def test_check_config_ok() -> None:
    r = kvengine("serve", "--listen", "0.0.0.0:8000", "--metrics-listen", "127.0.0.1:9401", "--kvstore", "h:1",
                 "--check-config")
    assert r.returncode == 0, r.stderr
    assert "serve on 0.0.0.0:8000, metrics on 127.0.0.1:9401, kvstore h:1" in r.stdout


@pytest.mark.parametrize("argv,env,needle", [
    (["serve", "--listen", "nowhere"], {}, "--listen must be HOST:PORT"),
    (["serve", "--metrics-listen", "9400"], {}, "--metrics-listen must be HOST:PORT"),
    (["serve", "--page-size", "3"], {}, "page_size must be a power of two"),
    (["serve"], {"TIERKV_BLEND_GATE_FRACTION": "7"}, "gate_fraction must be in [0, 1]"),
    (["serve", "--kvstore", "h:1"], {"TIERKV_CONNECTOR_LOAD_MODE": "bogus"}, "load_mode must be one of"),
    (["serve", "--kvstore", "h:1", "--kv-connector", "nope"], {}, "unknown plug-in 'nope'"),
    (["generate", "hi", "--kvstore", "nohost"], {}, "--kvstore must be HOST:PORT"),
    (["serve", "--kv-memory", "4gb"], {}, "bad size '4gb': units are case-sensitive: write 4G or 4GB"),
    (["serve"], {"TIERKV_ENGINE_KV_MEMORY": "512m"}, "TIERKV_ENGINE_KV_MEMORY='512m': bad size '512m'"),
])
def test_bad_config_is_one_line(argv: list[str], env: dict[str, str], needle: str) -> None:
    # without --check-config too: the check runs before the model loads
    for extra in (["--check-config"], []):
        r = kvengine(*argv, *extra, **env)
        assert r.returncode == 2, (argv, extra, r.stderr[-800:])
        assert needle in r.stderr and "Traceback" not in r.stderr, r.stderr[-800:]


def test_blend_env_is_not_checked_when_blending_is_off() -> None:
    r = kvengine("serve", "--no-blend", "--check-config", TIERKV_BLEND_GATE_FRACTION="7")
    assert r.returncode == 0, r.stderr


def test_plugin_variables_are_judged_by_the_plugins_that_are_loaded() -> None:
    """A plug-in declares its own variables (engine/plugins.py ``declares_env``): with the connector
    attached a misspelt TIERKV_CONNECTOR_* is warned with the closest name; without it, it is not
    the engine's to judge."""
    env = {"TIERKV_CONNECTOR_LOAD_MODEE": "auto", "TIERKV_CONNECTOR_CALIBRATION": "x"}
    r = kvengine("serve", "--no-blend", "--kvstore", "h:1", "--check-config", **env)
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and warnings[0].endswith(
        "unknown environment variable TIERKV_CONNECTOR_LOAD_MODEE ignored (did you mean TIERKV_CONNECTOR_LOAD_MODE?)")
    r = kvengine("serve", "--no-blend", "--check-config", **env)
    assert r.returncode == 0 and "WARNING" not in r.stderr, r.stderr


def test_host_port() -> None:
    assert host_port("[::1]:8000", "--listen") == ("::1", 8000)
    with pytest.raises(ConfigError, match="--listen"):
        host_port("host:99999", "--listen")


def test_sizes_unknown_variables_version_and_help() -> None:
    """Kubernetes sizes from flag and env; a misspelt TIERKV_* variable warned with the closest name while
    the daemon's and the connector's are not; --version; --help names each flag's default and variable."""
    r = kvengine("serve", "--no-blend", "--check-config", TIERKV_ENGINE_KV_MEMORY="2G", TIERKV_ENGIN_PAGE_SIZE="8",
                 TIERKV_CPU="1Gi", TIERKV_CONNECTOR_LOAD_MODE="auto")
    assert r.returncode == 0, r.stderr
    assert "kv_memory=2000000000" in r.stdout and "page_size=16" in r.stdout
    warnings = [line for line in r.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and warnings[0].endswith(
        "unknown environment variable TIERKV_ENGIN_PAGE_SIZE ignored (did you mean TIERKV_ENGINE_PAGE_SIZE?)")
    r = kvengine("--version")
    assert r.returncode == 0 and r.stdout.startswith("kvengine ")
    text = " ".join(kvengine("serve", "--help").stdout.split())
    assert "(default: 512Mi; env TIERKV_ENGINE_KV_MEMORY)" in text and "(default: 16; env TIERKV_ENGINE_PAGE_SIZE)" in text
