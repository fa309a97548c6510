"""The soak's tenants as credentials (bench/soak/tenancy.py): files the daemon and kvengine accept,
each tenant's token confined to its tenant, the engines' covering every tenant they serve."""

from __future__ import annotations

import stat
from pathlib import Path

from bench.soak.tenancy import ALL_TENANTS, LOAD_TENANTS, PROBE, SoakCredentials
from engine.tenancy import ApiKeys
from kvstore.keys import TENANT_MAGIC, tenant_tag
from kvstore.server.credentials import load_credentials


def _key(tenant: str) -> bytes:
    return TENANT_MAGIC + tenant_tag(tenant) + bytes(16)


def test_the_soaks_credentials_give_each_tenant_its_own_keys_only(tmp_path: Path) -> None:
    creds = SoakCredentials()
    cfile, kfile = creds.write(tmp_path)
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in (cfile, kfile))
    table = load_credentials(cfile)
    admin, engines = table.caller(creds.admin), table.caller(creds.engines)
    assert admin is not None and admin.sees_all
    assert engines is not None and not engines.sees_all and all(engines.may_write(_key(t)) for t in ALL_TENANTS)
    for t in ALL_TENANTS:
        caller = table.caller(creds.daemon[t])
        assert caller is not None and not caller.sees_all
        assert caller.may_read(_key(t)) and all(not caller.may_read(_key(o)) for o in ALL_TENANTS if o != t)
    keys = ApiKeys.load(kfile)
    assert {t: keys.tenant(f"Bearer {k}") for t, k in creds.api.items()} == {t: t for t in ALL_TENANTS}
    assert keys.tenant(f"Bearer {creds.daemon[PROBE]}") is None  # a daemon token is no API key
    assert PROBE not in LOAD_TENANTS  # no load client writes under the probe tenant's tag
    for secret in (creds.admin, creds.engines, *creds.daemon.values(), *creds.api.values()):
        assert secret not in repr(creds)
