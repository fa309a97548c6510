"""Byte sizes the Kubernetes way: ``G`` = 10^9, ``Gi`` = 2^30, a bare number is bytes.

Accepted (case-sensitive, an optional space before the unit, decimals allowed):

- decimal: ``k`` or ``K`` (10^3), ``M`` (10^6), ``G``, ``T``, ``P``, ``E``; with a trailing ``B``
  the meaning is the same (``4GB`` = ``4G`` = 4×10^9, ``kB``/``KB`` = 10^3);
- binary: ``Ki``, ``Mi``, ``Gi``, ``Ti``, ``Pi``, ``Ei``; ``KiB``, ``MiB``, ... mean the same;
- ``B`` or nothing: bytes.

Refused, with a line saying what to write instead: every other lowercase unit. ``4gb``/``4g`` are
ambiguous (Docker and ``free -g`` read them as GiB, SI as 10^9) and ``512m`` is *milli*-bytes to
Kubernetes, so guessing would give an operator a tier 7% or 1000× off what they meant.
A fractional result is rounded up to a whole byte, as Kubernetes does (``0.1Ki`` = 103).
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation

from tiers.errors import ConfigError

_PREFIX = "KMGTPE"
UNITS: dict[str, int] = {"": 1, "B": 1, "k": 10**3, "kB": 10**3}
for _i, _p in enumerate(_PREFIX, start=1):
    UNITS[_p] = UNITS[f"{_p}B"] = 1000**_i
    UNITS[f"{_p}i"] = UNITS[f"{_p}iB"] = 1024**_i
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([A-Za-z]*)\s*$")
ALLOWED = "a byte count or a number with a unit: 512Mi, 4Gi, 4GiB (2^30), 4G, 4GB (10^9); bare numbers are bytes"


class SizeError(ConfigError, ValueError):
    """A size string that is not a byte count (a ValueError too, so pydantic reports it per field)."""


def parse_size(value: str | int) -> int:
    """``'4Gi'`` -> 4294967296, ``'4G'`` -> 4000000000, ``'100'`` -> 100; an int is bytes already."""
    if isinstance(value, bool):
        raise SizeError(f"bad size {value!r}: {ALLOWED}")
    if isinstance(value, int):
        if value < 0:
            raise SizeError(f"bad size {value}: must be >= 0")
        return value
    m = _SIZE_RE.match(str(value))
    if m is None:
        raise SizeError(f"bad size {value!r}: {ALLOWED}")
    number, unit = m.groups()
    if unit not in UNITS:
        raise SizeError(f"bad size {value!r}: {_unit_hint(number, unit)}")
    try:
        exact = Decimal(number) * UNITS[unit]
    except InvalidOperation:  # pragma: no cover - the regex admits only decimals
        raise SizeError(f"bad size {value!r}: {ALLOWED}") from None
    return math.ceil(exact)


def _unit_hint(number: str, unit: str) -> str:
    """What to write instead of an unknown unit: the two readings of an ambiguous one, spelled out."""
    head = unit[:1].upper()
    if head in _PREFIX and unit.lower() in (head.lower(), f"{head.lower()}b", f"{head.lower()}i",
                                            f"{head.lower()}ib"):
        return (f"units are case-sensitive: write {number}{head} or {number}{head}B for {number}x10^"
                f"{3 * (_PREFIX.index(head) + 1)} bytes, or {number}{head}i or {number}{head}iB for "
                f"{number}x2^{10 * (_PREFIX.index(head) + 1)}")
    return f"unknown unit {unit!r}; {ALLOWED}"


def format_size(n: int) -> str:
    """Bytes as the largest binary unit that keeps one decimal (``67108864`` -> ``64.0 MiB``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(n)  # pragma: no cover
