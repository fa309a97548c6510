"""The credentials file and the one per-key rule (kvstore/server/credentials.py), without a daemon:
what each kind of credential may read and write, and every mistake in the file refused in one line
that never shows a token."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.config.store_config import load_config, load_settings
from kvstore.errors import PermissionDenied
from kvstore.keys import Namespace, chain_keys
from kvstore.server import credentials
from kvstore.server.auth import describe
from kvstore.server.credentials import ADMIN, Access, Caller, load_credentials
from kvstore.store.tenants import name_of_tenant
from tiers.errors import ConfigError

NS = Namespace.from_model({"n_layer": 2}, "sha256:c", "float32", page_size=4)
ACME = "acme-token-0123456789abcdef"
GLOBEX = "globex-token-0123456789abcdef"
OPS = "ops-token-0123456789abcdef0000"


def _key(ns: Namespace, seed: int = 0) -> bytes:
    return chain_keys(ns, [seed, seed + 1, seed + 2, seed + 3])[0]


A, A2 = _key(NS.in_tenant("acme")), _key(NS.in_tenant("acme", "salt-7"))
B = _key(NS.in_tenant("globex"))
UNTAGGED = _key(NS)
LEGACY = _key(NS.with_tenant("some-salt"))  # tagged by a salt, as single-token deployments key
SHARED = chain_keys(NS.in_tenant("acme"), [1, 2, 3, 4], shared_pages=1)[0]


def _file(tmp: Path, text: str) -> Path:
    p = tmp / "credentials.yaml"
    p.write_text(text)
    return p


def _good(tmp: Path) -> Path:
    (tmp / "acme.token").write_text(ACME + "\n")
    return _file(tmp, f"""
credentials:
  - token_file: acme.token        # relative to this file
    tenants: [acme]
  - token: "{GLOBEX}"
    tenants: [globex, default]
  - token: "{OPS}"
    admin: true
""")


def test_a_tenant_reads_and_writes_only_its_own_keys_and_reads_the_shared_ones() -> None:
    acme = Caller("acme's", tenants=("acme",))
    assert acme.may_read(A) and acme.may_write(A) and acme.may_write(A2)  # any salt inside its tenant
    for other in (B, UNTAGGED, LEGACY, b"opaque-key"):
        assert not acme.may_read(other) and not acme.may_write(other)
    assert acme.may_read(SHARED) and not acme.may_write(SHARED)
    both = Caller("engines", tenants=("acme", "default"))
    assert both.may_write(A) and both.may_write(UNTAGGED) and both.may_write(b"opaque-key") and not both.may_write(B)
    for k in (A, B, UNTAGGED, LEGACY, SHARED):
        assert ADMIN.may_read(k) and ADMIN.may_write(k)


def test_a_refusal_is_one_line_naming_only_the_callers_tenants() -> None:
    acme = Caller("credentials[0]", tenants=("acme",))
    acme.check([A, A2, SHARED])  # reads: fine
    with pytest.raises(PermissionDenied, match=r"key 1 is outside the tenants of credentials\[0\] \(acme\)") as e:
        acme.check([A, B])
    assert "globex" not in str(e.value) and len(str(e.value).splitlines()) == 1
    with pytest.raises(PermissionDenied, match="key 0 is in the shared namespace, which only an admin"):
        acme.check([SHARED], write=True)
    with pytest.raises(PermissionDenied, match="untagged"):
        acme.check([UNTAGGED])
    with pytest.raises(PermissionDenied, match="TraceStart needs an admin credential"):
        acme.check_admin("TraceStart")
    ADMIN.check_admin("TraceStart")


def test_the_file_maps_tokens_to_callers(tmp_path: Path) -> None:
    table = load_credentials(_good(tmp_path))
    assert table.tenants == ("acme", "default", "globex") and len(table) == 3
    acme, globex, ops = (table.caller(t) for t in (ACME, GLOBEX, OPS))
    assert acme is not None and acme.tenants == ("acme",) and not acme.admin
    assert globex is not None and globex.may_write(UNTAGGED) and globex.may_write(B) and not globex.may_read(A)
    assert ops is not None and ops.admin
    assert table.caller("not-a-token-of-this-file-000") is None
    assert ACME not in repr(table) and OPS not in repr(table) and ACME not in repr(acme)
    access = Access(table)
    assert access.caller([("authorization", f"Bearer {ACME}")]) == acme
    assert access.caller([("authorization", ACME)]) is None and access.caller([]) is None
    assert Access(None).caller([]) is ADMIN  # auth off: everyone is admin, as before
    assert table.display(name_of_tenant("acme")) == "acme"  # Stats show the configured name


@pytest.mark.parametrize("text,needle", [
    ("credentials: {}", "expected one key, credentials"),
    ("tenants: [a]", "expected one key, credentials"),
    (f'credentials:\n  - token: "{ACME}"', "list its tenants, or make it admin"),
    (f'credentials:\n  - token: "{ACME}"\n    admin: true\n    tenants: [a]', "covers every tenant"),
    (f'credentials:\n  - token: "{ACME}"\n    tenant: [acme]', "unknown key 'tenant'"),
    ('credentials:\n  - token: "short"\n    tenants: [acme]', "too short"),
    ('credentials:\n  - token_file: missing.token\n    tenants: [acme]', "cannot read token file"),
    (f'credentials:\n  - token: "{ACME}"\n    token_file: x\n    tenants: [acme]', "exactly one of"),
    (f'credentials:\n  - token: "{ACME}"\n    tenants: ["acme corp"]', "not a tenant name"),
    (f'credentials:\n  - token: "{ACME}"\n    tenants: [shared]', "reserved"),
    (f'credentials:\n  - token: "{ACME}"\n    admin: "yes"', "admin must be true or false"),
    (f'credentials:\n  - token: "{ACME}"\n    tenants: [a]\n  - token: "{ACME}"\n    tenants: [b]',
     r"credentials\[1\] has the same token as credentials\[0\]"),
    ("credentials: [", "cannot read credentials file"),
])
def test_every_mistake_is_one_line_without_a_token(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as e:
        load_credentials(_file(tmp_path, text))
    assert len(str(e.value).splitlines()) == 1 and ACME not in str(e.value)


def test_tenants_whose_tags_collide_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two names with one 6-byte tag would share every key. A real collision costs ~2^24 hashes, so
    the tag function is made to collide for two names here."""
    real = credentials.name_of_tenant
    monkeypatch.setattr(credentials, "name_of_tenant", lambda t: real("acme") if t == "globex" else real(t))
    text = f'credentials:\n  - token: "{ACME}"\n    tenants: [acme]\n  - token: "{GLOBEX}"\n    tenants: [globex]'
    with pytest.raises(ConfigError, match="tenants 'acme' and 'globex' have the same tag"):
        load_credentials(_file(tmp_path, text))


def test_the_daemon_takes_the_file_from_flag_env_or_yaml(tmp_path: Path) -> None:
    path = str(_good(tmp_path))
    assert load_config(["--cpu", "64Mi", "--credentials-file", path], env={}).credentials_file == path
    s = load_settings(["--cpu", "64Mi"], env={"TIERKV_CREDENTIALS_FILE": path})
    assert s.config.credentials_file == path and s.sources[("credentials_file",)] == "TIERKV_CREDENTIALS_FILE"
    yml = tmp_path / "kv.yaml"
    yml.write_text(f"credentials_file: {path}\n")
    cfg = load_config(["--cpu", "64Mi", "--config", str(yml)], env={})
    assert cfg.credentials_file == path
    lines = describe(cfg)
    assert "3 credentials" in lines[0] and "acme, default, globex" in lines[0]
    assert not any(t in "\n".join(lines) for t in (ACME, GLOBEX, OPS))


@pytest.mark.parametrize("extra,env,needle", [
    (["--no-auth"], {}, "credentials_file needs auth"),
    ([], {"TIERKV_TOKEN": OPS}, "put the admin token in it"),
    (["--token-file", "/x/token"], {}, "put the admin token in it"),
])
def test_the_file_replaces_the_one_token(tmp_path: Path, extra: list[str], env: dict[str, str], needle: str) -> None:
    """Which tokens are accepted is never ambiguous: the file's, and no other."""
    with pytest.raises(ConfigError, match=needle) as e:
        load_config(["--cpu", "64Mi", "--credentials-file", str(_good(tmp_path)), *extra], env=env)
    assert OPS not in str(e.value)


def test_a_bad_file_stops_the_daemon_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read credentials file"):
        load_config(["--cpu", "64Mi", "--credentials-file", str(tmp_path / "none.yaml")], env={})
