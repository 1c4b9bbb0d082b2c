"""A checkpoint's leaves against the state a run restores into: their paths and the one-line error
when they differ (:class:`acco_jax.ckpt.checkpoint.Checkpointer`'s check before it reads arrays)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from acco_jax import errors

PyTree = Any


def spec(shape, dtype) -> str:
  return f"{jnp.dtype(dtype).name}[{','.join(map(str, shape))}]"


def flatten(tree: PyTree, what: str) -> tuple[list[str], list[Any]]:
  """``(paths, leaves)`` of ``tree``, paths as ``jax.tree_util.keystr`` writes them."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  if not flat:
    raise ValueError(f"the {what} has no array leaves")
  return [jax.tree_util.keystr(p) for p, _ in flat], [x for _, x in flat]


def check_matches(
  directory, step: int, saved: dict, paths: list, leaves: list, shapes=True
) -> None:
  """Raises a one-line ValueError if the target is not the state the checkpoint was written for
  (with ``shapes=False``, if their leaf paths differ: a reshard converts the shapes)."""
  want = dict(zip(paths, leaves, strict=True))
  details = [
    f"target leaf {p} ({spec(x.shape, x.dtype)}) is not in the checkpoint"
    for p, x in want.items()
    if p not in saved
  ]
  details += [
    f"{p} is {spec(saved[p]['shape'], saved[p]['dtype'])} in the checkpoint but "
    f"{spec(x.shape, x.dtype)} in the target"
    for p, x in want.items()
    if shapes and p in saved and saved[p]["shape"] != tuple(x.shape)
  ]
  details += [
    f"checkpoint leaf {p} ({spec(e['shape'], e['dtype'])}) is not in the target"
    for p, e in saved.items()
    if p not in want
  ]
  if details:
    raise errors.UserValueError(
      f"the checkpoint at {directory} (step {step}) was written for a different state: "
      f"{details[0]} ({len(details)} leaves differ; {len(saved)} saved, {len(want)} in the "
      "target); resume with the config it was written with, or start in a new directory"
    )
