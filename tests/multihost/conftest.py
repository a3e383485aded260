"""Fixtures of the multi-host tests: a fresh `Network` of hosts per test, removed after it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.multihost.netns import Network


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/multihost/" in item.nodeid.replace("\\", "/"):
            item.add_marker(pytest.mark.multihost)
            item.add_marker(pytest.mark.distributed)
            # ./scripts/test runs them after the rest, one after another in one process (one xdist group):
            # their namespaces and addresses are fixed, one network at a time
            item.add_marker(pytest.mark.serial)
            item.add_marker(pytest.mark.xdist_group("multihost"))


@pytest.fixture
def net2() -> Iterator[Network]:
    """Two hosts, h0 (10.77.0.1) and h1 (10.77.0.2), each in its own network namespace."""
    with Network(2) as net:
        yield net
    assert Network.leftover() == []


@pytest.fixture
def net3() -> Iterator[Network]:
    """Three hosts, h0-h2 (10.77.0.1-3)."""
    with Network(3) as net:
        yield net
    assert Network.leftover() == []
