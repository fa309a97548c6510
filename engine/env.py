"""One way to read a frozen config dataclass from ``PREFIX_FIELD`` environment variables.

Used by the engine (TIERKV_ENGINE_*) and the connector (TIERKV_CONNECTOR_*); the kvstore daemon
has its own YAML + env loader (kvstore/config.py). Values are coerced by the field's declared type
(int, float, bool, str; a field named like ``*_memory``/``*_bytes`` of type int also takes sizes
such as 512MiB). A bad value is one clear line naming the variable.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping
from dataclasses import fields

from engine.errors import ConfigError

_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_size(value: str | int) -> int:
    """'4GiB' -> 4294967296, '1.5GB' -> 1500000000; plain ints are bytes."""
    if isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"bad size {value!r} (examples: 512MiB, 4GiB, 1.5GB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _coerce(name: str, ftype: str, raw: str) -> object:
    if ftype == "bool":
        if raw.lower() not in _TRUE + _FALSE:
            raise ValueError("expected true/false")
        return raw.lower() in _TRUE
    if ftype == "int":
        return parse_size(raw) if name.endswith(("_memory", "_bytes")) else int(raw)
    if ftype == "float":
        return float(raw)
    if ftype == "str":
        return raw
    raise ValueError(f"type {ftype} cannot be set from the environment")


def env_overrides(cls: type, prefix: str, skip: Collection[str] = (),
                  environ: Mapping[str, str] | None = None) -> dict[str, object]:
    """Field values of dataclass ``cls`` found in ``environ`` as ``{prefix}{FIELD}``."""
    environ = os.environ if environ is None else environ
    out: dict[str, object] = {}
    for f in fields(cls):
        var = f"{prefix}{f.name.upper()}"
        raw = environ.get(var)
        if raw is None or f.name in skip:
            continue
        ftype = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        try:
            out[f.name] = _coerce(f.name, ftype, raw)
        except (ValueError, ConfigError) as e:
            raise ConfigError(f"{var}={raw!r}: {e}") from None
    return out
