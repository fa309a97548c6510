"""Every ``TIERKV_*`` variable some tierkv program reads, so each CLI can warn about the others.

Daemon and engine often share a shell (and a compose file's ``x-`` anchors), so ``kvstore serve``
must not warn about ``TIERKV_ENGINE_KV_MEMORY`` and ``kvengine`` must not warn about
``TIERKV_CPU``; a misspelt one (``TIERKV_CPUS``) is warned by both, with the closest real name.
Names come from the programs themselves: the daemon's option table and StoreConfig fields, the
clients' variables (kvstore/server/auth.py), and the ``EnvDeclaration`` (engine/env.py) the engine and each
of its plug-ins declares for its own variables (imported only when a variable with their prefix is
set: the CacheBlend one imports torch). A new variable read outside these places belongs in EXTRA.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Mapping
from dataclasses import fields

PREFIX = "TIERKV_"
CLIENT = ("TIERKV_TOKEN", "TIERKV_TOKEN_FILE", "TIERKV_TLS_CA", "TIERKV_CLIENT_CERT", "TIERKV_CLIENT_KEY",
          "TIERKV_CACHE_DIR")  # kvstore/server/auth.py (every client and the daemon)
EXTRA = ("TIERKV_CONFIG", "TIERKV_GPU_CHECK_MODEL")
# prefix -> "module:attr" of the EnvDeclaration of the program or plug-in that reads it
PREFIXED = {
    "TIERKV_ENGINE_": "engine.config:ENV",
    "TIERKV_CONNECTOR_": "connector.config:ENV",
    "TIERKV_BLEND_": "connector.blend.hook:ENV",
}


def daemon_names() -> set[str]:
    from kvstore.config.flags import OPTIONS
    from kvstore.config.store_config import StoreConfig

    return {o.env for o in OPTIONS} | {f"{PREFIX}{f.name.upper()}" for f in fields(StoreConfig) if f.name != "tiers"}


def known(environ: Mapping[str, str]) -> set[str]:
    """The names any tierkv program reads (each prefixed family loaded only if ``environ`` uses it)."""
    names = daemon_names() | set(CLIENT) | set(EXTRA)
    for prefix, target in PREFIXED.items():
        if any(v.startswith(prefix) for v in environ):
            module, _, attr = target.partition(":")
            declared = getattr(importlib.import_module(module), attr)
            assert declared.prefix == prefix, (target, declared.prefix)
            names |= declared.names()
    return names


def unknown(environ: Mapping[str, str]) -> list[str]:
    """One warning line per ``TIERKV_*`` variable no tierkv program reads, with the closest real name."""
    ours = sorted(v for v in environ if v.startswith(PREFIX))
    if not ours:
        return []
    names = known(environ)
    if stray := [v for v in ours if v not in names]:
        names |= known(dict.fromkeys(PREFIXED, ""))  # near misses of a family not in use: TIERKV_ENGIN_X
    lines = []
    for var in stray:
        match = difflib.get_close_matches(var, sorted(names), n=1, cutoff=0.75)
        hint = f" (did you mean {match[0]}?)" if match else ""
        lines.append(f"unknown environment variable {var} ignored{hint}")
    return lines
