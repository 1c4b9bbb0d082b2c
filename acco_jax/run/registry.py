"""The families the run shell dispatches to, by ``config.method``: filled by the families.

The run shell never imports a family (``dp``, ``loco``, ``pipeline``, ``ensemble``): each family's
``family.py`` describes itself as an :class:`acco_jax.family_api.Family`, and
:mod:`acco_jax.families` registers them all when the package is imported. A new family is one
folder plus one line there.
"""

from __future__ import annotations

from acco_jax import errors
from acco_jax.family_api import Family

_BY_METHOD: dict[str, Family] = {}  # in registration order


def register(family: Family) -> Family:
  """Adds ``family``'s methods (each method belongs to one family)."""
  for method in family.methods:
    owner = _BY_METHOD.get(method)
    if owner is not None and owner.name != family.name:
      raise ValueError(f"method {method!r} is registered by family {owner.name!r} already")
  _BY_METHOD.update(dict.fromkeys(family.methods, family))
  return family


def methods() -> tuple[str, ...]:
  """Every registered method, in registration order."""
  return tuple(_BY_METHOD)


def lookup(method: str) -> Family:
  """The family that runs ``method``, or the one-line error that lists the methods."""
  family = _BY_METHOD.get(method)
  if family is None:
    raise errors.UserValueError(
      f"method={method!r} is unknown: choose one of {', '.join(methods())}"
    )
  return family
