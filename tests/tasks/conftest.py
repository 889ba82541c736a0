"""Fixtures of the task tests."""

import contextlib
import socket

import pytest


def _refuse(*args, **kwargs):
    raise OSError("network access is disabled in this test")


@contextlib.contextmanager
def network_disabled():
    """Fails any attempt to resolve a host name or open a connection inside the block, so
    a test proves that preparing data needs no download."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket, "getaddrinfo", _refuse)
        patch.setattr(socket.socket, "connect", _refuse)
        patch.setattr(socket.socket, "connect_ex", _refuse)
        yield


@pytest.fixture
def no_network():
    """The test runs with `network_disabled`."""
    with network_disabled():
        yield


@pytest.fixture(scope="module")
def no_network_in_module():
    """The rest of the module runs with `network_disabled` (for module-scoped data)."""
    with network_disabled():
        yield
