"""redact_url on a comma-separated list of cluster startup urls: every url's password is masked,
in the helper and in what the daemon logs (its effective configuration, a TierConfig's repr),
which it prints before RedisTier refuses credentials in any url but the first."""

from __future__ import annotations

import pytest

from kvstore.config.store_config import effective_lines, load_settings
from tiers.redact import redact_url

LIST = "redis://:pw1@10.0.0.2:6379/0,redis://:pw2@10.0.0.3:6379/0,rediss://u:pw3@h4:6380"
MASKED = "redis://:***@10.0.0.2:6379/0,redis://:***@10.0.0.3:6379/0,rediss://u:***@h4:6380"


@pytest.mark.parametrize(("url", "shown"), [
    (LIST, MASKED),
    ("redis://:pw1@a:6379,redis://:pw2@b:6379", "redis://:***@a:6379,redis://:***@b:6379"),  # no paths
    ("redis://a:6379/0,redis://:pw2@b:6379/0", "redis://a:6379/0,redis://:***@b:6379/0"),  # only a later one
    ("redis://a:1/0,redis://b:2/0?password=pw3", "redis://a:1/0,redis://b:2/0?password=***"),
    ("redis://a:1/0,redis://b:2/0", "redis://a:1/0,redis://b:2/0"),
    ("redis://:p,w1@h:6379/0", "redis://:***@h:6379/0"),  # a comma inside a password is not a list
])
def test_every_url_of_a_list_is_masked(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    for secret in ("pw1", "pw2", "pw3", "p,w1"):
        assert secret not in redact_url(url)


def test_the_daemons_logged_configuration_masks_every_startup_url() -> None:
    s = load_settings(["--cpu", "1Gi", "--redis", LIST, "--redis-cluster"], env={})
    text = "\n".join(effective_lines(s)) + repr(s.config.tiers)
    assert "pw1" not in text and "pw2" not in text and "pw3" not in text
    assert f"redis tier url = '{MASKED}'  (--redis)" in text
