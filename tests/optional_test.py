"""Optional-dependency probes answer False/None when a package (or its parent namespace) is
missing; they never raise, so a test module that probes at import time still collects."""

import sys

from acco_jax import optional, parallel


def test_has_cuda_plugin_without_the_jax_plugins_namespace(monkeypatch):
  # None in sys.modules makes importing the package fail, as when no PJRT plugin is installed.
  monkeypatch.setitem(sys.modules, "jax_plugins", None)
  assert parallel.has_cuda_plugin() is False


def test_probes_of_missing_modules_and_parents():
  assert optional.find_spec("acco_jax_no_such_package") is None
  assert optional.find_spec("acco_jax_no_such_package.sub") is None  # find_spec would raise here
  assert not optional.installed("acco_jax_no_such_package.sub")
  assert optional.package_dirs("acco_jax_no_such_package") == []


def test_probes_find_what_is_installed():
  assert optional.installed("acco_jax.dp.flat")
  assert any(d.endswith("acco_jax") for d in optional.package_dirs("acco_jax"))
