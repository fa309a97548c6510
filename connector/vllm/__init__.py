"""tierkv for vLLM: ``TierKVConnector``, loaded by vLLM as
``"kv_connector": "TierKVConnector", "kv_connector_module_path": "connector.vllm"``
(connector/vllm/connector.py has the whole configuration).

The package imports vLLM only when the connector class itself is asked for, so the planner, the
worker and the rest are importable (and unit-tested) without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TierKVConnector"]


def __getattr__(name: str) -> Any:
    if name == "TierKVConnector":
        from connector.vllm.connector import TierKVConnector

        return TierKVConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
