"""Plug-ins by name: what ``kvengine serve --kvstore ADDR`` (and CacheBlend) attach.

Like vLLM's KV connector factory: the engine never imports a plug-in's package; it resolves a
name to a ``"module:attr"`` factory and imports it only when a flag asks for it. Names come from,
in order: ``register()`` (tests, embedding code), the ``tierkv.plugins`` entry-point group of
installed packages, then the built-in table below. A name that is itself ``"module:attr"`` is
used as is. A factory is called with the engine and its arguments and installs itself. A factory may
carry a ``check_config`` attribute: called with the factory's arguments minus the engine, it
validates what the plug-in would read from the environment and raises ValueError
(``kvengine ... --check-config``, and before the model loads). A factory may also carry
``declares_env``: the engine/env.py ``EnvDeclaration`` (or a tuple of them) of every ``TIERKV_*``
variable the plug-in reads; ``kvengine`` judges unknown variables by its own declaration and those
of the plug-ins it loads (``env_declarations``), so the engine never lists a plug-in's variables.

Built-in plug-ins:
  tierkv      ``factory(engine, address)`` -> the tierkv KV connector on a kvstore daemon
  cacheblend  ``factory(engine)`` -> the server's CacheBlend front (or None if the model fails
              the self-check); its chunks go through the daemon when a connector is attached
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points

from engine.env import EnvDeclaration
from engine.errors import ConfigError

GROUP = "tierkv.plugins"
BUILTIN = {"tierkv": "connector.wiring:attach_tierkv", "cacheblend": "connector.wiring:attach_blend_frontend"}
_registered: dict[str, str] = {}


def register(name: str, target: str) -> None:
    """Make ``name`` resolve to ``target`` ("module:attr") in this process."""
    if ":" not in target:
        raise ConfigError(f"plug-in target must be 'module:attr', got {target!r}")
    _registered[name] = target


def _target(name: str) -> str:
    if name in _registered:
        return _registered[name]
    for ep in entry_points(group=GROUP):
        if ep.name == name:
            return ep.value
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" in name:
        return name
    known = sorted({*BUILTIN, *_registered, *(ep.name for ep in entry_points(group=GROUP))})
    raise ConfigError(f"unknown plug-in {name!r} (known: {', '.join(known)}; or give module:attr)")


def resolve(name: str) -> Callable[..., object]:
    """The factory registered under ``name``, imported now."""
    target = _target(name)
    module, _, attr = target.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"plug-in {name!r} -> {target!r} cannot be loaded: {e}") from e
    if not callable(obj):
        raise ConfigError(f"plug-in {name!r} -> {target!r} is not callable")
    return obj


def check(name: str, *args: object) -> None:
    """Validate plug-in ``name``'s configuration without building it (ValueError if it is bad)."""
    check_config = getattr(resolve(name), "check_config", None)
    if check_config is not None:
        check_config(*args)


def env_declarations(name: str) -> tuple[EnvDeclaration, ...]:
    """The environment variables plug-in ``name`` declares it reads (its factory's ``declares_env``)."""
    declared = getattr(resolve(name), "declares_env", ())
    return (declared,) if isinstance(declared, EnvDeclaration) else tuple(declared)
