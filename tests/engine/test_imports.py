"""engine/ stands alone: importing it (or running its CLI's --help, or --check-config without a plug-in)
loads neither connector/ nor kvstore/, with the engine's and the plug-ins' TIERKV_* variables set; they
are reached only by name, through the plug-in registry, when a flag asks for them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import plugins
from engine.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CHECK = "import sys; assert not any(m.split('.')[0] in ('connector', 'kvstore') for m in sys.modules), " \
        "sorted(m for m in sys.modules if m.split('.')[0] in ('connector', 'kvstore'))"


#: a variable of the engine and of each built-in plug-in, and a misspelt one: none may pull a plug-in in
TIERKV_ENV = {"TIERKV_ENGINE_PAGE_SIZE": "16", "TIERKV_CONNECTOR_LOAD_MODE": "auto", "TIERKV_BLEND_RATIO": "1.0",
              "TIERKV_ENGINE_PAGE_SIZ": "16"}


def _python(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIERKV_")}
    env.update(TIERKV_ENV, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_importing_engine_pulls_in_neither_connector_nor_kvstore() -> None:
    res = _python("import engine, engine.cli, engine.server, engine.scheduler, engine.engine, engine.async_engine, "
                  "engine.plugins, engine.hooks\n" + CHECK)
    assert res.returncode == 0, res.stderr


def test_engine_cli_help_pulls_in_neither() -> None:
    code = ("import sys, engine.cli\nfor cmd in (['--help'], ['serve', '--help'], ['generate', '--help']):\n"
            "    try:\n        engine.cli.main(cmd)\n    except SystemExit as e:\n        assert e.code == 0\n" + CHECK)
    res = _python(code)
    assert res.returncode == 0, res.stderr
    assert "--kvstore" in res.stdout and "--shutdown-grace-s" in res.stdout


def test_engine_cli_check_config_without_plugins_pulls_in_neither() -> None:
    code = ("import engine.cli\nfor cmd in (['serve', '--no-blend', '--check-config'], ['generate', 'hi', '--check-config']):\n"
            "    assert engine.cli.main(cmd) == 0\n" + CHECK)
    res = _python(code)
    assert res.returncode == 0, res.stderr
    assert "configuration OK" in res.stdout
    assert res.stderr.count("unknown environment variable TIERKV_ENGINE_PAGE_SIZ ignored") == 2, res.stderr


def test_plugins_resolve_by_name_lazily() -> None:
    res = _python("from engine import plugins\n" + CHECK + "\nf = plugins.resolve('tierkv')\n"
                  "import sys; assert 'connector.wiring' in sys.modules and f.__name__ == 'attach_tierkv'")
    assert res.returncode == 0, res.stderr
    with pytest.raises(ConfigError, match="unknown plug-in 'nope'"):
        plugins.resolve("nope")
    with pytest.raises(ConfigError, match="cannot be loaded"):
        plugins.resolve("no_such_module_xyz:thing")
    plugins.register("mine", "os.path:join")
    assert plugins.resolve("mine") is os.path.join
