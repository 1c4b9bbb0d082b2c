"""Elastic restore of the owner layout: owners reassigned for another device count.

:class:`acco_jax.dp.owner.OwnerLayout` gives each owned matrix to one device and each device the same
slots, so both the owners and the number of slots depend on ``N``. A state saved on ``N_old``
devices is converted on the host, item by item (nothing is computed, every value moves bit for
bit):

- ``params`` (the shards view) and every optimizer-state leaf shaped like one of its slots or
  elementwise chunks (Muon's momentum per matrix, Adam's moments per chunk, ACCO's committed copy):
  the old shards are put back into the parameters' shapes (:meth:`OwnerLayout.from_shards`) and cut
  again for the new owners (:meth:`OwnerLayout.to_shards`). Which state leaves those are is found
  as in :mod:`acco_jax.dp.reshard`, by running the optimizer's ``init`` on a tagged view (slot ``t``
  shaped ``(..., TAG + t)``). The leaves tagged with strictly increasing slots form one *copy* of
  the view (a momentum, a second moment); the old and new states have the same copies in the same
  order, each over the slots of the same parameters.
- every other optimizer-state leaf (step counts, injected hyperparameters, Newton–Schulz
  coefficients) is one value per device, the same on every device (the optimizer runs ``vmap``-ped
  over the devices): the first row is kept for every new device. A leaf that differs between
  devices, or a per-slot leaf of another shape (Adafactor's factored moments), cannot be moved: a
  one-line ``ValueError``.
- ``w`` and the per-device rows of ``buf`` (delayed methods): flat buffers of the layout, moved the
  same way; rows merge or move as :func:`acco_jax.dp.reshard.merge_rows` says.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from acco_jax.dp.owner import OwnerLayout
from acco_jax.dp.reshard import merge_rows, probe_tags, saved_num_devices

PyTree = Any


def _tags(tx, layout: OwnerLayout):
  """``(treedef of the vmapped state, per leaf: the shards leaf it is shaped like, or None)``."""
  tags, _ = probe_tags(tx.init, layout.shard_shapes(1), lambda x: x.ndim - 1)
  whole = jax.tree.structure(jax.eval_shape(jax.vmap(tx.init), layout.shard_shapes()))
  return whole, tags


def _copies(tags: list) -> list[list[int]]:
  """Positions of the tagged leaves, cut into copies: a copy's tags strictly increase."""
  out = []
  for i, t in enumerate(tags):
    if t is None:
      continue
    if not out or t <= tags[out[-1][-1]]:
      out.append([])
    out[-1].append(i)
  return out


def _move(values: dict[int, np.ndarray], old: OwnerLayout, new: OwnerLayout, want: list[int]):
  """The new shards ``want`` of one copy from the old shards ``values`` (tag -> array)."""
  like = jax.tree.leaves(old.shard_shapes())
  dtype = next(iter(values.values())).dtype
  leaves = [values.get(t, np.zeros(x.shape, dtype)) for t, x in enumerate(like)]
  tree = old.from_shards(jax.tree.structure(old.shard_shapes()).unflatten(leaves), dtype)
  got = jax.tree.leaves(new.to_shards(tree, dtype))
  covered = set().union(*(h for t, h in enumerate(old.holders()) if t in values))
  if not set().union(*(new.holders()[t] for t in want)) <= covered:
    raise ValueError("the optimizer state covers other parameters on this device count")
  return [np.asarray(got[t]) for t in want]


def per_device(x, n_old: int, n_new: int, where: str) -> np.ndarray:
  """A leaf with one (equal) value per device -> ``n_new`` copies of it."""
  x = np.asarray(x)
  if x.shape[:1] != (n_old,) or not all(np.array_equal(x[0], r, equal_nan=True) for r in x):
    raise ValueError(
      f"optimizer state leaf {where} differs between devices (a per-matrix value not shaped like "
      f"its matrix) and cannot move to {n_new} devices; resume on {n_old} devices"
    )
  return np.broadcast_to(x[:1], (n_new, *x.shape[1:])).copy()


def source_layout(layout: OwnerLayout, num_shards: int) -> OwnerLayout:
  """The same parameters and owned leaves laid out for ``num_shards`` devices."""
  like = [jax.ShapeDtypeStruct(s, d) for s, d in zip(layout.shapes, layout.dtypes, strict=True)]
  whole = layout.treedef.unflatten(layout.whole)
  return OwnerLayout(layout.treedef.unflatten(like), num_shards, whole)


def saved_structure(old: OwnerLayout, old_tx, delayed: bool, comm_dtype) -> dict:
  """The fields (``ShapeDtypeStruct`` trees) of a ``TrainState`` saved with ``old`` and ``old_tx``
  (what a checkpoint of that device count holds: other slots than this run's, so other paths)."""
  n, padded = old.num_shards, old.padded_size
  shards = old.shard_shapes()
  return dict(
    w=jax.ShapeDtypeStruct((padded,), comm_dtype),
    params=shards,
    opt_state=jax.eval_shape(jax.vmap(old_tx.init), shards),
    buf=jax.ShapeDtypeStruct((n, padded), comm_dtype) if delayed else None,
    buf_count=jax.ShapeDtypeStruct((n,), jnp.int32) if delayed else None,
    stage=jax.ShapeDtypeStruct((), jnp.int32),
  )


def reshard_owner_state(saved, old_tx, layout: OwnerLayout, tx, comm_dtype):
  """A ``TrainState`` of host arrays saved with the owner layout on any ``N`` -> for ``layout``.

  Args:
    saved: the state as read from a checkpoint (numpy leaves, the saved shapes).
    old_tx: the method transform on the saved device count (its masks are in that count's view).
    layout: the target :class:`OwnerLayout` (its ``num_shards`` is the new ``N``).
    tx: the method transform of ``layout`` (each ``init`` says which state leaves are slot-shaped).
    comm_dtype: the dtype of the compute weights ``w``.

  Returns:
    The state with numpy leaves shaped for ``layout``; every value moved bit for bit, the gradient
    rows merged as :func:`acco_jax.dp.reshard.merge_rows` says.

  Raises:
    ValueError: the saved state is not this model's and optimizer's, or holds a per-device leaf
      that cannot move (see the module docstring).
  """
  n_old, n_new = saved_num_devices(saved), layout.num_shards
  old = source_layout(layout, n_old)
  old_def, old_tags = _tags(old_tx, old)
  new_def, new_tags = _tags(tx, layout)
  opt = jax.tree.leaves(saved.opt_state)
  old_copies, new_copies = _copies(old_tags), _copies(new_tags)
  plain_old = [i for i, t in enumerate(old_tags) if t is None]
  plain_new = [i for i, t in enumerate(new_tags) if t is None]
  shards_old = jax.tree.leaves(saved.params)
  if (
    jax.tree.structure(saved.opt_state) != old_def
    or len(old_copies) != len(new_copies)
    or len(plain_old) != len(plain_new)
    or [tuple(np.shape(x)) for x in shards_old]
    != [x.shape for x in jax.tree.leaves(old.shard_shapes())]
  ):
    raise ValueError(
      f"it holds another model or optimizer than this one on {n_old} devices (or one whose state "
      "per matrix is not shaped like it); resume with the config it was written with"
    )
  out = [None] * len(new_tags)
  for a, b in zip(old_copies, new_copies, strict=True):
    values = {old_tags[i]: np.asarray(opt[i]) for i in a}
    for i, x in zip(b, _move(values, old, layout, [new_tags[i] for i in b]), strict=True):
      out[i] = x
  paths = jax.tree_util.tree_flatten_with_path(saved.opt_state)[0]
  for i, j in zip(plain_old, plain_new, strict=True):
    out[j] = per_device(opt[i], n_old, n_new, f"opt_state{jax.tree_util.keystr(paths[i][0])}")
  every = range(len(jax.tree.leaves(layout.shard_shapes())))
  params = _move(dict(enumerate(np.asarray(x) for x in shards_old)), old, layout, list(every))
  convert = lambda flat: np.asarray(layout.ravel(old.unravel(flat, flat.dtype), flat.dtype))
  state = saved._replace(
    w=convert(np.asarray(saved.w, comm_dtype)),
    params=jax.tree.structure(layout.shard_shapes()).unflatten(params),
    opt_state=new_def.unflatten(out),
  )
  if getattr(saved, "residual", None) is not None:
    raise ValueError("a quantized residual does not occur with the owner layout")
  if saved.buf is not None:
    buf, count = merge_rows(
      np.asarray(saved.buf), np.asarray(saved.buf_count), n_new, layout.padded_size, convert
    )
    state = state._replace(buf=buf, buf_count=count)
  return state
