"""One way to read a frozen config dataclass from ``PREFIX_FIELD`` environment variables.

Used by the engine (TIERKV_ENGINE_*) and its plug-ins (each with its own prefix); the kvstore daemon
has its own YAML + env loader (kvstore/config/store_config.py). Values are coerced by the field's declared type
(int, float, bool, str; a field named like ``*_memory``/``*_bytes`` of type int also takes sizes
such as 512Mi: Kubernetes units, G = 10^9, Gi = 2^30, bare numbers are bytes, lowercase refused as
ambiguous). A bad value is one clear line naming the variable.

An ``EnvDeclaration`` says which variables one program or plug-in reads (its prefix, its config
dataclass, a few whole names): the engine declares its own (engine/config.py), each plug-in
declares its own on its factory (engine/plugins.py ``declares_env``), and the unknown-variable
warnings are computed from the declarations of what is loaded.

engine/ imports neither kvstore/ nor connector/ (tests/engine/test_imports.py), so the size rule is
written here a second time; tests/kvstore/test_sizes.py holds both to the same table.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, fields
from decimal import Decimal

from engine.errors import ConfigError

_UNITS = {"": 1, "B": 1, "k": 10**3, "kB": 10**3}
for _i, _p in enumerate("KMGTPE", start=1):
    _UNITS[_p] = _UNITS[f"{_p}B"] = 1000**_i
    _UNITS[f"{_p}i"] = _UNITS[f"{_p}iB"] = 1024**_i
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([A-Za-z]*)\s*$")

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_size(value: str | int) -> int:
    """'4Gi' -> 4294967296, '4G' -> 4000000000; plain ints are bytes (the rule of kvstore/config/sizes.py)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    m = _SIZE.match(str(value)) if isinstance(value, str) else None
    if m is None:
        raise ConfigError(f"bad size {value!r}: a byte count or a number with a unit: 512Mi, 4Gi (2^30), 4G (10^9)")
    number, unit = m.groups()
    if unit not in _UNITS:
        head, n = unit[:1].upper(), "KMGTPE".find(unit[:1].upper()) + 1
        hint = (f"units are case-sensitive: write {number}{head} or {number}{head}B for {number}x10^{3 * n} bytes, "
                f"or {number}{head}i or {number}{head}iB for {number}x2^{10 * n}" if head and n else
                f"unknown unit {unit!r}")
        raise ConfigError(f"bad size {value!r}: {hint}")
    return math.ceil(Decimal(number) * _UNITS[unit])


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


@dataclass(frozen=True)
class EnvDeclaration:
    """The ``TIERKV_*`` variables one program or plug-in reads: ``{prefix}{FIELD}`` for each field of the
    dataclass ``config`` but those in ``skip``, and the whole names in ``extra``."""

    prefix: str
    config: type
    skip: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()

    def names(self) -> frozenset[str]:
        fields_ = {f"{self.prefix}{f.name.upper()}" for f in fields(self.config) if f.name not in self.skip}
        return frozenset(fields_ | set(self.extra))

    def overrides(self, environ: Mapping[str, str] | None = None) -> dict[str, object]:
        """The config fields this environment sets (``env_overrides``)."""
        return env_overrides(self.config, self.prefix, skip=self.skip, environ=environ)
