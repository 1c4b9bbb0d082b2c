"""The owner layout's optimizer state to and from the model's structure (``ckpt.init_from``).

With ``layout='owner'`` (:mod:`acco_jax.dp.owner`) the inner optimizer runs ``vmap``-ped over the
devices on the layout's *shards* view: per device, a slot per owned matrix and a chunk per
elementwise leaf, and its masks are in that view. So its state has neither the model's structure
nor the elementwise layout's, and :func:`acco_jax.ckpt.portable.map_param_subtrees` finds no
parameter-shaped subtree in it. The portable form of such a state is the state the *same inner
optimizer built on the model's tree* (``tree_tx``: its masks in the model's structure) would hold,
which is what a ``ddp`` run with whole leaves holds:

- the state leaves shaped like one slot or chunk of the view (Muon's momentum, Adam's moments),
  found by a tagged ``init`` as in :mod:`acco_jax.dp.reshard_owner`, form *copies* of the view, one
  per subtree of the state (a momentum, a second moment: the leaves under one path); each copy is
  put back into the parameters' shapes (:meth:`OwnerLayout.from_shards`) and its leaves fill the
  copy under the same path in ``tree_tx``'s state (found by the same tagging on the model's tree).
  The two states have the same subtrees, each over the same parameters: they run the same
  transforms, one on matrices and chunks, one on whole leaves.
- every other leaf (step counts, injected hyperparameters, Newton–Schulz coefficients) is one
  value per device, equal on every device: the first row is the model's value, and back, it is
  broadcast to every device.

Every value moves bit for bit; nothing is computed. A per-matrix leaf of another shape (Adafactor's
factored moments) is a one-line ``ValueError``, as for the elastic restore.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from acco_jax.dp.owner import OwnerLayout
from acco_jax.dp.reshard import probe_tags
from acco_jax.dp.reshard_owner import per_device

PyTree = Any


def _copies(tags: list, prefixes: list) -> dict[str, list[int]]:
  """The tagged leaves by the subtree they belong to (a momentum, a second moment), in order."""
  out = {}
  for i, (t, prefix) in enumerate(zip(tags, prefixes, strict=True)):
    if t is not None:
      out.setdefault(prefix, []).append(i)
  return out


def _pairs(layout: OwnerLayout, inner_tx, tree_tx, params_like):
  """The owner state's structure and tags, the tree state's shapes and tags, the copies paired
  by their subtree's path, and the other leaves paired in order."""
  owner_tags, owner_prefixes = probe_tags(
    inner_tx.init, layout.shard_shapes(1), lambda x: x.ndim - 1
  )
  owner_def = jax.tree.structure(jax.eval_shape(jax.vmap(inner_tx.init), layout.shard_shapes()))
  tree_tags, tree_prefixes = probe_tags(tree_tx.init, params_like, lambda x: len(x.shape))
  owner_copies, tree_copies = _copies(owner_tags, owner_prefixes), _copies(tree_tags, tree_prefixes)
  plain_owner = [i for i, t in enumerate(owner_tags) if t is None]
  plain_tree = [i for i, t in enumerate(tree_tags) if t is None]
  if list(owner_copies) != list(tree_copies) or len(plain_owner) != len(plain_tree):
    raise ValueError(
      "the optimizer's state on the owner layout does not map to its state on the model's tree "
      f"({len(owner_copies)} per-item subtrees and {len(plain_owner)} other leaves against "
      f"{len(tree_copies)} and {len(plain_tree)}): another inner optimizer"
    )
  copies = [(owner_copies[k], tree_copies[k]) for k in owner_copies]
  tree_like = jax.eval_shape(tree_tx.init, params_like)
  return (
    owner_def,
    owner_tags,
    tree_like,
    tree_tags,
    copies,
    list(zip(plain_owner, plain_tree, strict=True)),
  )


def _covers(layout: OwnerLayout, owner_copy: list, owner_tags: list, tree_params: set) -> None:
  """A copy on the owner layout and its pair on the model's tree hold the same parameters."""
  held = layout.holders()
  if set().union(*(held[owner_tags[i]] for i in owner_copy)) != tree_params:
    raise ValueError("the optimizer state covers other parameters on the model's tree")


def to_model(inner_state, layout: OwnerLayout, inner_tx, tree_tx, params_like) -> PyTree:
  """The owner layout's inner state (host numpy, leaves ``[N, ...]`` on ``layout``'s ``N``) ->
  ``tree_tx``'s state on the model's tree (see the module)."""
  owner_def, owner_tags, tree_like, tree_tags, copies, plain = _pairs(
    layout, inner_tx, tree_tx, params_like
  )
  if jax.tree.structure(inner_state) != owner_def:
    raise ValueError("its optimizer state is not this inner optimizer's on the owner layout")
  leaves = [np.asarray(x) for x in jax.tree.leaves(inner_state)]
  like = jax.tree.leaves(tree_like)
  shard_like = jax.tree.leaves(layout.shard_shapes())
  out = [None] * len(like)
  for a, b in copies:
    _covers(layout, a, owner_tags, {tree_tags[i] for i in b})
    values = {owner_tags[i]: leaves[i] for i in a}
    dtype = leaves[a[0]].dtype
    shards = [values.get(t, np.zeros(x.shape, dtype)) for t, x in enumerate(shard_like)]
    tree = layout.from_shards(jax.tree.structure(layout.shard_shapes()).unflatten(shards), dtype)
    model_leaves = jax.tree.leaves(tree)
    for i in b:
      out[i] = np.asarray(model_leaves[tree_tags[i]])
  paths = jax.tree_util.tree_flatten_with_path(inner_state)[0]
  for i, j in plain:
    where = f"opt_state{jax.tree_util.keystr(paths[i][0])}"
    out[j] = per_device(leaves[i], layout.num_shards, 1, where)[0]
    if out[j].shape != tuple(like[j].shape):
      raise ValueError(f"{where} is {out[j].shape} per device, {like[j].shape} on the model's tree")
  return jax.tree.structure(tree_like).unflatten(out)


def to_owner(tree_state, layout: OwnerLayout, inner_tx, tree_tx, params_like) -> PyTree:
  """``tree_tx``'s state on the model's tree (host numpy) -> the owner layout's inner state on
  ``layout`` (leaves ``[N, ...]``); the inverse of :func:`to_model`."""
  owner_def, owner_tags, _, tree_tags, copies, plain = _pairs(
    layout, inner_tx, tree_tx, params_like
  )
  leaves = [np.asarray(x) for x in jax.tree.leaves(tree_state)]
  params = jax.tree.leaves(params_like)
  treedef = jax.tree.structure(params_like)
  out = [None] * len(owner_tags)
  for a, b in copies:
    _covers(layout, a, owner_tags, {tree_tags[i] for i in b})
    values = {tree_tags[i]: leaves[i] for i in b}
    dtype = leaves[b[0]].dtype
    tree = treedef.unflatten(
      [values.get(t, np.zeros(x.shape, dtype)) for t, x in enumerate(params)]
    )
    shards = jax.tree.leaves(layout.to_shards(tree, dtype))
    for i in a:
      out[i] = np.asarray(shards[owner_tags[i]])
  n = layout.num_shards
  for i, j in plain:
    out[i] = np.broadcast_to(leaves[j][None], (n, *leaves[j].shape)).copy()
  return owner_def.unflatten(out)
