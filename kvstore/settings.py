"""Where a StoreConfig comes from: defaults, YAML, ``TIERKV_*`` env and flags, merged field by field.

Precedence, per field (later wins): built-in default < YAML file (``--config`` or
``TIERKV_CONFIG``) < environment < command-line flag. Tiers merge by kind and by field: ``--cpu 8Gi``
changes the cpu tier's capacity and keeps its YAML eviction policy; ``--redis URL`` changes the
URL of a YAML redis tier and keeps its capacity and TTL. With no tier configured anywhere the
embedded default is a 1 GiB cpu tier over a 10 GiB disk tier under ``$TIERKV_CACHE_DIR/disk``.

Every value then passes one pydantic model (built from the StoreConfig/TierConfig fields, so a new
field needs no second declaration); a bad one is one line naming the field, where it came from and
what is allowed. Unknown YAML keys and unknown ``TIERKV_*`` variables are warnings, with the
closest valid name. The frozen dataclasses' own ``__post_init__`` keeps the cross-field rules.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, fields
from pathlib import Path as FsPath
from typing import Annotated, Any, Literal, NamedTuple

import yaml
from pydantic import BeforeValidator, ValidationError, create_model

from kvstore import env_names
from kvstore.config import KINDS, StoreConfig, TierConfig, default_cache_dir
from kvstore.options import CONFIG_ENV, Path, build_arg_parser, flag_values, tier_env_values
from kvstore.sizes import parse_size
from tiers.errors import ConfigError
from tiers.redact import redact_url

log = logging.getLogger("kvstore.config")
SCALARS = tuple(f.name for f in fields(StoreConfig) if f.name != "tiers")
TIER_FIELDS = tuple(f.name for f in fields(TierConfig))
SECRETS = frozenset({"token", "access_key_id", "secret_access_key"})
KIND_DEFAULTS: dict[str, dict[str, Any]] = {  # what a tier of each kind is unless told otherwise
    "cpu": {"capacity_bytes": 1024**3},
    "disk": {"capacity_bytes": 10 * 1024**3},
    "redis": {"capacity_bytes": 4 * 1024**3, "shared": True, "write_through": True},
    "s3": {"capacity_bytes": 1024**4, "shared": True},
}
_S3_ENV = {"endpoint": "AWS_ENDPOINT_URL", "region": "AWS_DEFAULT_REGION", "access_key_id": "AWS_ACCESS_KEY_ID",
           "secret_access_key": "AWS_SECRET_ACCESS_KEY"}
_REQUIRED = {"disk": ("path", "--disk PATH[:SIZE], TIERKV_DISK or a YAML tier's path"),
             "redis": ("url", "--redis redis://host:port/db, TIERKV_REDIS or a YAML tier's url"),
             "s3": ("url", "--s3 s3://bucket/prefix, TIERKV_S3 or a YAML tier's url")}
Layer = dict[Path, tuple[Any, str]]  # path -> (value, where it came from)


class Settings(NamedTuple):
    config: StoreConfig
    sources: dict[Path, str]  # where each field's value came from ("default", "--cpu", "TIERKV_LISTEN", ...)
    warnings: list[str]


def _pyd_type(name: str, declared: str) -> Any:
    if name == "kind":
        return Literal[KINDS]  # type: ignore[valid-type]
    if declared == "int" and name.endswith("_bytes"):
        return Annotated[int, BeforeValidator(parse_size)]
    return {"int": int, "float": float, "bool": bool, "str": str}[declared]


def _model(cls: type, name: str, extra: Mapping[str, Any] = {}) -> Any:  # noqa: B006 - read only
    spec = {f.name: (_pyd_type(f.name, str(f.type)), ...) for f in fields(cls) if f.name not in extra}
    return create_model(name, __config__={"extra": "forbid"}, **spec, **{k: (v, ...) for k, v in extra.items()})


TierModel = _model(TierConfig, "TierSettings")
StoreModel = _model(StoreConfig, "StoreSettings", {"tiers": list[TierModel]})  # type: ignore[valid-type]


def _closest(name: str, valid: Sequence[str]) -> str:
    match = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


@dataclass
class _Yaml:
    layer: Layer
    kinds: list[str]
    warnings: list[str]


def _read_yaml(path: str) -> _Yaml:
    try:
        doc = yaml.safe_load(FsPath(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read config {path}: {' '.join(str(e).split())}") from None
    doc = {} if doc is None else doc
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of settings, got {type(doc).__name__}")
    out = _Yaml({}, [], [])
    for key, value in doc.items():
        if key == "tiers":
            _read_yaml_tiers(path, value, out)
        elif key in SCALARS:
            out.layer[(key,)] = (value, f"{path}: {key}")
        else:
            out.warnings.append(f"{path}: unknown key {key!r} ignored{_closest(str(key), (*SCALARS, 'tiers'))}")
    return out


def _read_yaml_tiers(path: str, tiers: Any, out: _Yaml) -> None:
    if not isinstance(tiers, list):
        raise ConfigError(f"{path}: tiers must be a list of mappings with a kind, got {type(tiers).__name__}")
    keys = (*TIER_FIELDS, "capacity")
    for i, tier in enumerate(tiers):
        where = f"{path}: tiers[{i}]"
        if not isinstance(tier, dict) or tier.get("kind") not in KINDS:
            got = tier.get("kind") if isinstance(tier, dict) else tier
            raise ConfigError(f"{where}.kind = {got!r}: must be one of {', '.join(KINDS)}")
        kind = tier["kind"]
        if kind in out.kinds:
            raise ConfigError(f"{where}: a second {kind} tier (tiers[{out.kinds.index(kind)}] is one): "
                              "each kind may appear once")
        out.kinds.append(kind)
        for key, value in tier.items():
            name = "capacity_bytes" if key == "capacity" else key
            if key not in keys or key == "kind":
                if key != "kind":
                    out.warnings.append(f"{where} ({kind}): unknown key {key!r} ignored{_closest(str(key), keys)}")
                continue
            out.layer[("tiers", kind, name)] = (value, f"{where}.{key}")


def _chain(listed: Sequence[str], added: Sequence[str]) -> list[str]:
    """The YAML's tier order, with tiers added by env or flags at their place in cpu > disk > redis > s3."""
    out = list(listed)
    for kind in added:
        later = [i for i, k in enumerate(out) if KINDS.index(k) > KINDS.index(kind)]
        out.insert(later[0] if later else len(out), kind)
    return out


def _env_layer(env: Mapping[str, str]) -> Layer:
    layer: Layer = {}
    for name in SCALARS:
        if (raw := env.get(f"TIERKV_{name.upper()}")) is not None:
            layer[(name,)] = (raw, f"TIERKV_{name.upper()}")
    for option, values in tier_env_values(dict(env)):
        layer.update({path: (v, option.env) for path, v in values.items()})
    return layer


def _defaults(kinds: Sequence[str], env: Mapping[str, str], embedded: bool) -> Layer:
    layer: Layer = {(f.name,): (f.default, "default") for f in fields(StoreConfig) if f.default is not MISSING}
    for kind in kinds:
        for f in fields(TierConfig):
            if f.default is not MISSING:
                layer[("tiers", kind, f.name)] = (f.default, "default")
        layer[("tiers", kind, "kind")] = (kind, "default")
        layer.update({("tiers", kind, k): (v, "default") for k, v in KIND_DEFAULTS[kind].items()})
    if "s3" in kinds:
        layer[("tiers", "s3", "region")] = ("us-east-1", "default")
        for name, var in _S3_ENV.items():
            if env.get(var):
                layer[("tiers", "s3", name)] = (env[var], var)
    if embedded:
        layer[("tiers", "disk", "path")] = (str(default_cache_dir(env) / "disk"), "default ($TIERKV_CACHE_DIR)")
    return layer


def load_settings(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> Settings:
    """The StoreConfig of ``kvstore serve ARGV`` under ``env``, where each value came from, and warnings.

    Raises ConfigError (one line per bad value) for anything invalid; never a traceback."""
    env = dict(os.environ if env is None else env)
    args = build_arg_parser().parse_args(list(argv or []))
    path = args.config or env.get(CONFIG_ENV)
    yml = _read_yaml(path) if path else _Yaml({}, [], [])
    env_layer = _env_layer(env)
    flag_layer: Layer = {}
    for option, values in flag_values(args):
        flag_layer.update({p: (v, option.flag) for p, v in values.items()})
    given = [p[1] for lay in (yml.layer, env_layer, flag_layer) for p in lay if p[:1] == ("tiers",) and p[1] != "*"]
    kinds = _chain(yml.kinds, [k for k in KINDS if k in given and k not in yml.kinds])
    embedded = not kinds
    kinds = kinds or ["cpu", "disk"]
    merged: Layer = {}
    for layer in (_defaults(kinds, env, embedded), yml.layer, env_layer, flag_layer):
        for p, value in layer.items():
            for target in ([("tiers", k, *p[2:]) for k in kinds] if p[1:2] == ("*",) else [p]):
                merged[target] = value
    config = _validate(merged, kinds)
    warnings = yml.warnings + env_names.unknown(env)
    for line in warnings:
        log.warning("%s", line)
    return Settings(config, {p: src for p, (_, src) in merged.items()}, warnings)


def _validate(merged: Layer, kinds: Sequence[str]) -> StoreConfig:
    doc: dict[str, Any] = {"tiers": [{} for _ in kinds]}
    for p, (value, _) in merged.items():
        if p[0] == "tiers":
            doc["tiers"][kinds.index(p[1])][p[2]] = value
        else:
            doc[p[0]] = value
    try:
        model = StoreModel.model_validate(doc)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = err["loc"]
            p = ("tiers", kinds[loc[1]], *map(str, loc[2:])) if loc[0] == "tiers" and len(loc) > 2 else tuple(
                map(str, loc))
            value, source = merged.get(p, (None, "?"))
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{_name(p)} = {_shown(p, value)} (from {source}): {msg}")
        raise ConfigError("\n".join(lines)) from None
    data = model.model_dump()
    for t in data["tiers"]:
        need, how = _REQUIRED.get(t["kind"], ("", ""))
        if need and not t[need]:
            why = sorted({src for p, (_, src) in merged.items() if p[:2] == ("tiers", t["kind"]) and src != "default"})
            raise ConfigError(f"{t['kind']} tier {need} is required ({how}); the tier is configured by {', '.join(why)}")
    tiers = tuple(TierConfig(**t) for t in data.pop("tiers"))
    return StoreConfig(tiers=tiers, **data)


def _name(p: Path) -> str:
    return f"{p[1]} tier {p[2]}" if p[0] == "tiers" and len(p) > 2 else ".".join(p)


def _shown(p: Path, value: Any) -> str:
    """A value as logs may show it: secrets masked, URL passwords masked."""
    if p[-1] in SECRETS:
        return "'***'" if value else "''"
    if p[-1] in ("url", "endpoint") and isinstance(value, str):
        return repr(redact_url(value))
    return repr(value)


def effective_lines(settings: Settings) -> list[str]:
    """The effective configuration, one ``field = value  (source)`` per line, secrets masked."""
    cfg = settings.config
    lines = [f"{name} = {_shown((name,), getattr(cfg, name))}  ({settings.sources.get((name,), 'default')})"
             for name in SCALARS]
    defaults = {f.name: f.default for f in fields(TierConfig)}
    for t in cfg.tiers:
        for name in TIER_FIELDS:
            p = ("tiers", t.kind, name)
            if name == "capacity_bytes" or (name != "kind" and getattr(t, name) != defaults[name]):
                lines.append(f"{_name(p)} = {_shown(p, getattr(t, name))}  ({settings.sources.get(p, 'default')})")
    return lines
