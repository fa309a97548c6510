"""A topology factory for the cluster tests: skips only where this machine cannot make namespaces."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from bench.cluster.topology import NamespacesUnavailable, Topology, TopologyConfig


@pytest.fixture
def make_topology() -> Iterator[Callable[..., Topology]]:
    made: list[Topology] = []

    def make(**config: object) -> Topology:
        try:
            topo = Topology(TopologyConfig(**config))  # type: ignore[arg-type]
        except NamespacesUnavailable as e:
            pytest.skip(f"no network namespaces on this machine: {e}")
        made.append(topo)
        return topo

    yield make
    for topo in made:
        topo.close()
