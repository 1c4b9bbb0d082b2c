"""Optional dependencies, located without importing them. A probe answers; it never raises.

``importlib.util.find_spec("a.b")`` imports ``a`` to look inside it, so it raises
``ModuleNotFoundError`` when ``a`` is missing (e.g. the ``jax_plugins`` namespace when no PJRT plugin
is installed), and ``ValueError`` for a module whose ``__spec__`` is unset. Every probe in the project
goes through :func:`find_spec` here instead.
"""

from __future__ import annotations

import importlib.util


def find_spec(name: str):
  """The module spec of ``name``, or ``None`` if it (or a parent package) is not installed."""
  try:
    return importlib.util.find_spec(name)
  except (ImportError, ValueError):
    return None


def installed(name: str) -> bool:
  """Whether module ``name`` can be imported (nothing is imported to find out, but its parents)."""
  return find_spec(name) is not None


def package_dirs(name: str) -> list[str]:
  """The directories of package ``name`` (to read data files it ships), ``[]`` if not installed."""
  spec = find_spec(name)
  return list(spec.submodule_search_locations or []) if spec else []
