"""Reading an optax optimizer's state: pure, no JAX computation, used by the algorithms and the run
shell alike."""

from __future__ import annotations


def find_state(state, predicate):
  """The first node of an optax state (tuples, lists and dicts, depth first) that ``predicate``
  accepts, or None."""
  if predicate(state):
    return state
  if isinstance(state, tuple | list):
    for s in state:
      found = find_state(s, predicate)
      if found is not None:
        return found
  if isinstance(state, dict):
    for s in state.values():
      found = find_state(s, predicate)
      if found is not None:
        return found
  return None
