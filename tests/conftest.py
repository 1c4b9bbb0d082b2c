"""Test setup: 8 simulated CPU devices, set before the JAX backend starts; shared fixtures."""

import os
import socket

import pytest

_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture
def no_network(monkeypatch):
  """Every socket connection and DNS lookup fails at once (as offline, without the wait)."""

  def refuse(*args, **kwargs):
    raise OSError("network access is disabled in tests")

  monkeypatch.setattr(socket, "getaddrinfo", refuse)
  monkeypatch.setattr(socket, "create_connection", refuse)
  monkeypatch.setattr(socket.socket, "connect", refuse)
