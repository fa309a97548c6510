"""kvstore/config/store_config.py: the field-by-field merge (flag > env > YAML > default), one line per bad value
naming the field and where it came from, warnings for unknown YAML keys and TIERKV_* variables, and
the refusals (duplicate YAML tiers, a tier smaller than one block)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvstore.config.store_config import effective_lines, load_settings
from tiers.errors import ConfigError


def _yaml(tmp_path: Path, doc: object) -> str:
    f = tmp_path / "kv.yaml"
    f.write_text(yaml.safe_dump(doc))
    return str(f)


REDIS_YAML = {"tiers": [{"kind": "cpu", "capacity": "2Gi", "eviction": "arc"},
                        {"kind": "disk", "path": "/yaml/disk", "capacity": "50Gi", "admit_min_hits": 2},
                        {"kind": "redis", "url": "redis://yaml-host:6379/0", "capacity": "8Gi", "ttl_s": 600,
                         "write_through": False}]}  # fmt: skip


def test_a_flag_changes_one_field_of_a_yaml_tier(tmp_path: Path) -> None:
    path = _yaml(tmp_path, REDIS_YAML)
    s = load_settings(["--config", path, "--redis-capacity", "2Gi", "--cpu", "3Gi", "--disk", "/flag/disk"], env={})
    t = {x.kind: x for x in s.config.tiers}
    assert [x.kind for x in s.config.tiers] == ["cpu", "disk", "redis"]  # the YAML's order
    assert t["redis"].capacity_bytes == 2 << 30
    assert (t["redis"].url, t["redis"].ttl_s, t["redis"].write_through) == ("redis://yaml-host:6379/0", 600, False)
    assert (t["cpu"].capacity_bytes, t["cpu"].eviction) == (3 << 30, "arc")
    assert (t["disk"].path, t["disk"].capacity_bytes, t["disk"].admit_min_hits) == ("/flag/disk", 50 << 30, 2)
    s = load_settings(["--config", path, "--redis", "redis://flag-host:6379/1", "--eviction", "s3fifo"], env={})
    t = {x.kind: x for x in s.config.tiers}
    assert (t["redis"].url, t["redis"].capacity_bytes, t["redis"].ttl_s) == ("redis://flag-host:6379/1", 8 << 30, 600)
    assert {x.eviction for x in s.config.tiers} == {"s3fifo"}


def test_precedence_per_field_and_sources(tmp_path: Path) -> None:
    path = _yaml(tmp_path, {"listen": "127.0.0.1:1111", "workers": 3, **REDIS_YAML})
    env = {"TIERKV_CONFIG": path, "TIERKV_LISTEN": "127.0.0.1:2222", "TIERKV_REDIS_CAPACITY": "1Gi"}
    s = load_settings([], env=env)
    assert s.config.listen == "127.0.0.1:2222" and s.config.workers == 3
    assert s.config.tiers[2].capacity_bytes == 1 << 30 and s.config.tiers[2].ttl_s == 600
    assert s.sources[("listen",)] == "TIERKV_LISTEN" and s.sources[("workers",)] == f"{path}: workers"
    assert s.sources[("tiers", "redis", "capacity_bytes")] == "TIERKV_REDIS_CAPACITY"
    assert s.sources[("grace_s",)] == "default"
    s = load_settings(["--listen", "127.0.0.1:3333", "--redis-capacity", "3Gi"], env=env)
    assert s.config.listen == "127.0.0.1:3333" and s.config.tiers[2].capacity_bytes == 3 << 30
    assert s.sources[("listen",)] == "--listen"
    assert s.config.tiers[0].eviction == "arc"  # untouched by env and flags: still the YAML's


def test_a_tier_added_by_a_flag_takes_its_place_in_the_chain(tmp_path: Path) -> None:
    path = _yaml(tmp_path, {"tiers": [{"kind": "cpu", "capacity": "1Gi"}, {"kind": "s3", "url": "s3://b/p"}]})
    s = load_settings(["--config", path, "--disk", f"{tmp_path}/disk:1Gi", "--redis", "redis://h:1/0"], env={})
    assert [t.kind for t in s.config.tiers] == ["cpu", "disk", "redis", "s3"]  # not behind the slowest tier


def test_kind_defaults_are_the_same_from_yaml_and_flags(tmp_path: Path) -> None:
    """A redis tier is write-through and shared whether it came from --redis or from YAML."""
    from_flag = load_settings(["--redis", "redis://h:1/0"], env={}).config.tiers[0]
    from_yaml = load_settings(["--config", _yaml(tmp_path, {"tiers": [{"kind": "redis", "url": "redis://h:1/0"}]})],
                              env={}).config.tiers[0]
    assert from_flag == from_yaml and from_flag.write_through and from_flag.shared


def test_duplicate_yaml_tiers_refused(tmp_path: Path) -> None:
    path = _yaml(tmp_path, {"tiers": [{"kind": "cpu", "capacity": "1Gi"}, {"kind": "cpu", "capacity": "2Gi"}]})
    with pytest.raises(ConfigError, match=r"tiers\[1\]: a second cpu tier \(tiers\[0\] is one\)"):
        load_settings(["--config", path], env={})


def test_a_tier_smaller_than_one_block_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="smaller than one block.*did you mean 512Mi"):
        load_settings(["--cpu", "512"], env={})  # bare numbers are bytes: 512 B holds no KV page
    assert load_settings(["--cpu", "64Ki"], env={}).config.tiers[0].capacity_bytes == 64 << 10
    path = _yaml(tmp_path, {"min_block_bytes": 256, "tiers": [{"kind": "cpu", "capacity": 512}]})
    assert load_settings(["--config", path], env={}).config.tiers[0].capacity_bytes == 512  # the operator lowered it


@pytest.mark.parametrize("argv,env,doc,needle", [
    (["--cpu", "4gb"], {}, None, "cpu tier capacity_bytes = '4gb' (from --cpu): bad size '4gb': units are case"),
    ([], {"TIERKV_WORKERS": "abc"}, None, "workers = 'abc' (from TIERKV_WORKERS): Input should be a valid integer"),
    ([], {"TIERKV_SHM": "maybe"}, None, "shm = 'maybe' (from TIERKV_SHM): Input should be a valid boolean"),
    ([], {"TIERKV_CPU": "lots"}, None, "cpu tier capacity_bytes = 'lots' (from TIERKV_CPU): bad size"),
    (["--metrics-port", "x"], {}, None, "metrics_port = 'x' (from --metrics-port): Input should be a valid integer"),
    ([], {}, {"listen": 8000}, "listen = 8000 (from KV: listen): Input should be a valid string"),
    ([], {}, {"tiers": [{"kind": "cpu", "capacity": "1Gi", "eviction": "mru"}]}, "unknown eviction policy 'mru'"),
    ([], {}, {"tiers": [{"kind": "tape"}]}, "KV: tiers[0].kind = 'tape': must be one of cpu, disk, redis, s3"),
    ([], {}, {"tiers": {"kind": "cpu"}}, "KV: tiers must be a list"),
    ([], {}, ["listen"], "KV: the top level must be a mapping"),
    ([], {}, {"tiers": [{"kind": "redis", "url": "redis://h:1", "ttl_s": "soon"}]},
     "redis tier ttl_s = 'soon' (from KV: tiers[0].ttl_s): Input should be a valid integer"),
    (["--s3-capacity", "1Ti"], {}, None, "s3 tier url is required (--s3 s3://bucket/prefix, TIERKV_S3 or a YAML "
                                         "tier's url); the tier is configured by --s3-capacity"),
    ([], {"TIERKV_TOKEN": "hunter2-is-not-a-number", "TIERKV_GRACE_S": "x"}, None,
     "grace_s = 'x' (from TIERKV_GRACE_S): Input should be a valid number"),
])  # fmt: skip
def test_bad_value_is_one_line_naming_field_and_source(tmp_path: Path, argv: list[str], env: dict[str, str],
                                                       doc: object, needle: str) -> None:
    if doc is not None:
        path = _yaml(tmp_path, doc)
        argv, needle = ["--config", path, *argv], needle.replace("KV:", f"{path}:")
    with pytest.raises(ConfigError) as e:
        load_settings(argv, env=env)
    assert str(e.value).count("\n") == 0 and needle in str(e.value), str(e.value)
    assert "hunter2" not in str(e.value)


def test_every_bad_value_gets_its_own_line() -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(["--cpu", "4gb"], env={"TIERKV_WORKERS": "abc"})
    lines = str(e.value).splitlines()
    assert len(lines) == 2 and lines[0].startswith("workers = 'abc'") and lines[1].startswith("cpu tier capacity")


def test_unknown_yaml_keys_and_env_variables_warned(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _yaml(tmp_path, {"lisen": "127.0.0.1:1", "tiers": [{"kind": "cpu", "capacity": "1Gi", "evicton": "arc"}]})
    env = {"TIERKV_CPUS": "1Gi", "TIERKV_ENGINE_KV_MEMORY": "1Gi", "TIERKV_CONNECTOR_LOAD_MODE": "auto",
           "TIERKV_ENGINE_KV_MEMROY": "1Gi", "TIERKV_TOKEN_FILE": "/x", "TIERKV_ZZZ": "1"}
    with caplog.at_level("WARNING", logger="kvstore.config"):
        s = load_settings(["--config", path], env=env)
    assert s.warnings == [
        f"{path}: unknown key 'lisen' ignored (did you mean 'listen'?)",
        f"{path}: tiers[0] (cpu): unknown key 'evicton' ignored (did you mean 'eviction'?)",
        "unknown environment variable TIERKV_CPUS ignored (did you mean TIERKV_CPU?)",
        "unknown environment variable TIERKV_ENGINE_KV_MEMROY ignored (did you mean TIERKV_ENGINE_KV_MEMORY?)",
        "unknown environment variable TIERKV_ZZZ ignored",
    ]  # the engine's and the clients' own variables are not warned about
    assert [r.getMessage() for r in caplog.records] == s.warnings
    assert s.config.listen == "127.0.0.1:50551" and s.config.tiers[0].eviction == "lru"  # ignored, nothing else lost


def test_effective_config_masks_secrets() -> None:
    token = "t0ken-" + "s" * 40
    env = {"TIERKV_TOKEN": token, "AWS_ACCESS_KEY_ID": "AKIDSECRET", "AWS_SECRET_ACCESS_KEY": "sk-very-secret"}
    s = load_settings(["--cpu", "1Gi", "--redis", "redis://:hunter2@127.0.0.1:6379/0", "--s3", "s3://b/p",
                       "--s3-endpoint", "http://u:pw2@127.0.0.1:8333"], env=env)
    text = "\n".join(effective_lines(s))
    for secret in (token, "AKIDSECRET", "sk-very-secret", "hunter2", "pw2"):
        assert secret not in text
    assert "token = '***'  (TIERKV_TOKEN)" in text and "s3 tier secret_access_key = '***'  (AWS_SECRET_ACCESS_KEY)" in text
    assert "redis tier url = 'redis://:***@127.0.0.1:6379/0'  (--redis)" in text
    assert "cpu tier capacity_bytes = 1073741824  (--cpu)" in text


def test_operations_doc_names_every_flag_variable_and_field() -> None:
    """docs/operations.md's configuration reference cannot fall behind the option table and StoreConfig."""
    from kvstore.config.flags import OPTIONS
    from kvstore.config.store_config import SCALARS

    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    missing = [o.flag for o in OPTIONS if o.flag not in doc] + [o.env for o in OPTIONS if o.env not in doc]
    missing += [f"`{name}`" for name in SCALARS if f"`{name}`" not in doc]
    assert not missing, f"docs/operations.md does not mention {missing}"
