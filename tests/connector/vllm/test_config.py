"""The vLLM connector's extra config: defaults, and one-line refusals that name the key."""

from __future__ import annotations

import pytest

from connector.vllm.config import ConnectorConfigError, VLLMConnectorConfig


def test_only_the_daemon_address_is_required() -> None:
    cfg = VLLMConnectorConfig.from_extra({"kvstore": "127.0.0.1:50051"})
    assert cfg.load_mode == "auto" and cfg.save and cfg.use_shm is None
    assert VLLMConnectorConfig.from_extra({"kvstore": "h:1", "load_deadline_s": 3}).load_deadline_s == 3.0
    assert cfg.tenant == "" and VLLMConnectorConfig.from_extra({"kvstore": "h:1", "tenant": "acme"}).tenant == "acme"


@pytest.mark.parametrize(("extra", "names"), [
    ({}, "kvstore"),
    ({"kvstore": "nohostport"}, "kvstore"),
    ({"kvstore": "h:99999"}, "kvstore"),
    ({"kvstore": "h:1", "lookup_deadline": 1}, "lookup_deadline"),  # a typo is refused, not ignored
    ({"kvstore": "h:1", "save": "yes"}, "save"),
    ({"kvstore": "h:1", "known_keys": 1.5}, "known_keys"),
    ({"kvstore": "h:1", "min_prefill_samples": True}, "min_prefill_samples"),
    ({"kvstore": "h:1", "load_mode": "sometimes"}, "load_mode"),
    ({"kvstore": "h:1", "load_deadline_s": 0}, "load_deadline_s"),
    ({"kvstore": "h:1", "retry_after_failure_s": -1}, "retry_after_failure_s"),
    ({"kvstore": "h:1", "tenant": "acme corp"}, "tenant"),
    ({"kvstore": "h:1", "tenant": "shared"}, "tenant"),
    ({"kvstore": "h:1", "tenant": 3}, "tenant"),
])  # fmt: skip
def test_bad_config_is_one_line_naming_the_key(extra: dict, names: str) -> None:
    with pytest.raises(ConnectorConfigError) as e:
        VLLMConnectorConfig.from_extra(extra)
    msg = str(e.value)
    assert names in msg and "\n" not in msg


def test_config_is_frozen() -> None:
    cfg = VLLMConnectorConfig.from_extra({"kvstore": "h:1"})
    with pytest.raises(AttributeError):
        cfg.save = False  # type: ignore[misc]
