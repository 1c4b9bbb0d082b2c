"""Each pipeline stage's parameters in flat buffers: the embedding and head held once, stages of any
size.

A stage-axis mesh shards an array evenly, so a tree with the model's structure would put every leaf
on every stage (the embedding and head replicated) and every stage would need the same number of
blocks. Instead each stage keeps its own parameters end to end in one flat buffer per weight-decay
group ``g`` (``decay``: matrices and embeddings; ``nodecay``: biases and LayerNorms; see
``model.decay_mask``), and the mesh holds ``{g: [S, P_g]}`` sharded over ``stage``:

.. code-block:: none

  stage 0   [ block 0 | ... | block c_0 - 1 |    shared     | zeros ]
  stage s   [ block a_s | ... | block a_s + c_s - 1 |            zeros ]      a_s = c_0 + ... + c_{s-1}
            <- slot 0 -><- ... (K slots of one block's g-elements) ->
  P_g = max(K * block_g, c_0 * block_g + shared_g), rounded up to a multiple of ``multiple``

``c_s`` blocks on stage ``s`` (``counts``), ``K = max_s c_s``. Inside the step every stage reads the
same views at the same offsets (one SPMD program): :meth:`StagePacking.blocks` reads the K slots as
stacked blocks (stage ``s`` runs the first ``c_s``), :meth:`StagePacking.shared` reads the shared
parameters (``model.shared``: the embeddings, final norm and an untied head, whatever the
architecture names them) at stage 0's offset. On stage 0 the slots ``c_0 .. K-1``
overlap the shared leaves and are never run; on the other stages the shared view is never used. The
gradient of a buffer is the pull-back of both views (:meth:`StagePacking.grads`), so overlapping reads
add up and unused ones add zeros.

Memory per device is ``sum_g P_g`` parameters: the embedding and head once (on stage 0), and no more
than the largest stage; padding is what a stage has fewer than the largest, which a split balanced
by time (:func:`balanced_counts`: stage 0, which also runs the head, gets fewer blocks) mostly fills
with the shared leaves. Padding elements have zero gradients and stay zero under elementwise
optimizers (weight decay of zero is zero).

``pack`` and ``unpack`` move numbers and never change them (numpy in, numpy out; jax in, jax out),
so a checkpoint converts between this layout and the model's bit for bit.

**Whole matrices** (``matrices=``, Muon: ``opt.name=muon``). An optimizer that updates each weight
matrix whole cannot run on flat buffers cut over the data lanes. With a mask of the block's
matrices the packing takes them out of ``decay`` into a third buffer, ``matrices``, of ``K'``
slots (``K`` rounded up to a multiple of the lanes; the extra slots stay zero), nothing else in it:

.. code-block:: none

  matrices  [ slot 0: block's matrices | slot 1 | ... | slot K' - 1 ]     P_m = K' * block_m

Cut over ``L`` lanes (ZeRO-1, ACCO) each lane holds ``K' / L`` whole slots: the owner layout over a
stage's lanes, with no collective beyond the elementwise layout's (the reduce-scatter lands each
matrix on its owner). :meth:`StagePacking.view` shows the optimizer that buffer as ``[S, K', a, b]``
stacks of matrices (the leading axes are batch axes for Muon) beside the other buffers, and
:func:`on_view` runs an optax transform on that view. A zero slot stays zero under Muon's
Newton–Schulz iterations and its weight decay.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from acco_jax import errors, model

GROUPS = ("decay", "nodecay")
MATRICES = "matrices"


class _Leaf(NamedTuple):
  path: tuple  # keys from the block (or the model root) to the leaf
  shape: tuple[int, ...]
  size: int
  group: str
  offset: int  # inside one block's slot (blocks) or the shared region (shared), per group


def _keys(path) -> tuple:
  return tuple(k.key for k in path)


def _get(tree, keys):
  for k in keys:
    tree = tree[k]
  return tree


def _set(tree: dict, keys, value) -> None:
  for k in keys[:-1]:
    tree = tree.setdefault(k, {})
  tree[keys[-1]] = value


def _leaves(tree, mask, whole=None) -> tuple[list[_Leaf], dict[str, int]]:
  out, used = [], dict.fromkeys((MATRICES, *GROUPS), 0)
  masked = dict(jax.tree_util.tree_leaves_with_path(mask))
  whole = dict(jax.tree_util.tree_leaves_with_path(whole)) if whole is not None else {}
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    group = MATRICES if whole.get(path) else GROUPS[0] if masked[path] else GROUPS[1]
    size = int(np.prod(x.shape))
    out.append(_Leaf(_keys(path), tuple(x.shape), size, group, used[group]))
    used[group] += size
  return out, used


def parse_counts(spec: str, num_blocks: int, num_stages: int) -> tuple[int, ...] | None:
  """``pipeline.blocks_per_stage``: ``auto`` (None: :func:`balanced_counts`) or a comma list that
  leaves no stage empty and sums to the model's blocks; anything else is a one-line error."""
  if str(spec).strip() in ("", "auto"):
    return None
  try:
    counts = tuple(int(c) for c in str(spec).replace(" ", "").strip("()[]").split(","))
  except ValueError:
    counts = ()
  if len(counts) != num_stages or min(counts, default=0) < 1 or sum(counts) != num_blocks:
    raise errors.UserValueError(
      f"pipeline.blocks_per_stage={spec!r} must list {num_stages} block counts (one per stage, "
      f"each >= 1) that sum to the model's {num_blocks} blocks, e.g. "
      f"{','.join(map(str, balanced_counts_for(num_blocks, num_stages, 0.0)))}; or 'auto'"
    )
  return counts


def head_cost(cfg: model.ModelConfig) -> float:
  """The head's forward FLOPs per token in units of one block's: ``2 V D`` (padded rows
  included: they are computed) against a block's share of the architecture's forward FLOPs
  (:func:`acco_jax.model.flops_per_token`, a third of them, less the head's ``2 V D``)."""
  forward = model.flops_per_token(cfg) / 3 - 2 * cfg.V * cfg.D
  return 2 * cfg.padded_vocab * cfg.D / (forward / cfg.N)


def balanced_counts_for(num_blocks: int, num_stages: int, head: float) -> tuple[int, ...]:
  """Blocks per stage minimising the slowest stage's time, stage 0 costing ``head`` blocks more;
  every stage gets at least one block. Ties: the more even split of the other stages."""
  if not 1 <= num_stages <= num_blocks:
    raise errors.UserValueError(
      f"pipeline.stages={num_stages} must be between 1 and the model's {num_blocks} blocks (each "
      "stage holds one or more)"
    )
  best = None
  for first in range(1, num_blocks - num_stages + 2):
    rest, others = num_blocks - first, num_stages - 1
    if others == 0 and rest:
      continue
    per, extra = divmod(rest, others) if others else (0, 0)
    counts = (first, *([per + 1] * extra + [per] * (others - extra)))
    key = (max(first + head, per + (extra > 0)), -first)
    if best is None or key < best[0]:
      best = (key, counts)
  return best[1]


def balanced_counts(cfg: model.ModelConfig, num_stages: int) -> tuple[int, ...]:
  """:func:`balanced_counts_for` with the head's cost from the model's shapes."""
  return balanced_counts_for(cfg.N, num_stages, head_cost(cfg))


def equal_counts(num_blocks: int, num_stages: int) -> tuple[int, ...]:
  return (num_blocks // num_stages,) * num_stages


class StagePacking:
  """Maps the model's parameters to per-stage flat buffers and back (see the module docstring).

  Args:
    params_like: the model's parameter tree (arrays or ``ShapeDtypeStruct``), one dtype.
    counts: blocks per stage, each >= 1, summing to the model's blocks.
    multiple: every buffer length is a multiple of this (the data lanes that shard it).
    matrices: a pytree of bools like one block's parameters, True for the matrices an optimizer
      updates whole (``model.muon_mask(params)['blocks']['0']``): they go to the ``matrices``
      buffer, ``multiple`` divides its slots (see the module docstring). None: no such buffer.

  Attributes:
    counts, starts: blocks per stage and each stage's first block.
    slots: ``K``, the most blocks on one stage.
    matrix_slots: ``K'``, the slots of the ``matrices`` buffer (0 without one).
    sizes: ``{g: P_g}``, buffer length per group.
  """

  def __init__(self, params_like, counts, multiple: int = 1, matrices=None):
    counts = tuple(int(c) for c in counts)
    blocks = params_like[model.BLOCKS]
    if min(counts) < 1 or sum(counts) != len(blocks):
      raise ValueError(f"counts {counts} must be >= 1 and sum to {len(blocks)} blocks")
    dtypes = {jnp.dtype(x.dtype) for x in jax.tree.leaves(params_like)}
    if len(dtypes) != 1:
      raise ValueError(f"the parameters must share one dtype, got {sorted(map(str, dtypes))}")
    self.dtype = dtypes.pop()
    self.counts, self.num_stages = counts, len(counts)
    self.starts = tuple(int(x) for x in np.cumsum((0, *counts[:-1])))
    self.slots = max(counts)
    shared = model.shared(params_like)
    self._block, self._block_sizes = _leaves(blocks["0"], model.decay_mask(blocks["0"]), matrices)
    self._shared, shared_sizes = _leaves(shared, model.decay_mask(shared))
    self._shared_at = {g: counts[0] * self._block_sizes[g] for g in GROUPS}
    self.sizes, self.matrix_slots = {}, 0
    if self._block_sizes[MATRICES]:
      self.matrix_slots = math.ceil(self.slots / multiple) * multiple
      self.sizes[MATRICES] = self.matrix_slots * self._block_sizes[MATRICES]
    for g in GROUPS:
      need = max(self.slots * self._block_sizes[g], self._shared_at[g] + shared_sizes[g])
      if need:
        self.sizes[g] = math.ceil(need / multiple) * multiple
    self.num_params = sum(x.size for x in jax.tree.leaves(params_like))

  # -- host and traced conversions (numbers moved, never changed) ----------------------------------

  def like(self) -> dict:
    """``{g: ShapeDtypeStruct([S, P_g])}``."""
    return {
      g: jax.ShapeDtypeStruct((self.num_stages, n), self.dtype) for g, n in self.sizes.items()
    }

  def pack(self, params) -> dict:
    """The model's parameters -> ``{g: [S, P_g]}`` (numpy for numpy leaves, else jax)."""
    xp = np if all(isinstance(x, np.ndarray) for x in jax.tree.leaves(params)) else jnp
    rows = {g: [] for g in self.sizes}
    for s, (a, c) in enumerate(zip(self.starts, self.counts, strict=True)):
      parts = {g: [] for g in self.sizes}
      for b in range(a, a + c):
        for leaf in self._block:
          parts[leaf.group].append(_get(params[model.BLOCKS][str(b)], leaf.path).reshape(-1))
      if s == 0:
        for leaf in self._shared:
          parts[leaf.group].append(_get(params, leaf.path).reshape(-1))
      for g, n in self.sizes.items():
        row = xp.concatenate(parts[g]) if parts[g] else xp.zeros((0,), self.dtype)
        rows[g].append(xp.pad(row.astype(self.dtype), (0, n - row.shape[0])))
    return {g: xp.stack(r) for g, r in rows.items()}

  def unpack(self, packed) -> dict:
    """``{g: [S, P_g]}`` -> the model's parameters (the inverse of :meth:`pack`)."""
    out = {model.BLOCKS: {}}
    for s, (a, c) in enumerate(zip(self.starts, self.counts, strict=True)):
      for k, b in enumerate(range(a, a + c)):
        block = {}
        for leaf in self._block:
          at = k * self._block_sizes[leaf.group] + leaf.offset
          _set(block, leaf.path, packed[leaf.group][s, at : at + leaf.size].reshape(leaf.shape))
        out[model.BLOCKS][str(b)] = block
    for leaf in self._shared:
      at = self._shared_at[leaf.group] + leaf.offset
      _set(out, leaf.path, packed[leaf.group][0, at : at + leaf.size].reshape(leaf.shape))
    return out

  # -- views of one stage's buffers, inside the step ------------------------------------------------

  def blocks(self, local) -> dict:
    """One stage's ``{g: [P_g]}`` -> its K slots as stacked blocks (leaves ``[K, ...]``)."""
    K, out = self.slots, {}
    for leaf in self._block:
      n = self._block_sizes[leaf.group]
      slots = local[leaf.group][: K * n].reshape(K, n)
      _set(out, leaf.path, slots[:, leaf.offset : leaf.offset + leaf.size].reshape(K, *leaf.shape))
    return out

  def shared(self, local) -> dict:
    """One stage's ``{g: [P_g]}`` -> the shared parameters (``model.shared``) at stage 0's offsets."""
    out = {}
    for leaf in self._shared:
      at = self._shared_at[leaf.group] + leaf.offset
      _set(out, leaf.path, local[leaf.group][at : at + leaf.size].reshape(leaf.shape))
    return out

  def grads(self, local, d_blocks, d_shared) -> dict:
    """The gradient of one stage's buffers from the gradients of its two views."""
    _, pull = jax.vjp(lambda b: (self.blocks(b), self.shared(b)), local)
    return pull((d_blocks, d_shared))[0]

  def decay_mask(self) -> dict:
    """``opt.decay=matrices`` on the buffers: ``{decay: True, nodecay: False}`` (and
    ``matrices: True``)."""
    return {g: g != GROUPS[1] for g in self.sizes}

  # -- the optimizer's view of whole matrices (``matrices=``) ----------------------------------------

  def view(self, buffers) -> dict:
    """``{g: [S, P_g]}`` -> the same with ``matrices`` as ``{leaf path: [S, K', *shape]}`` (one
    block's structure, each leaf stacked over stages and slots); the identity without it."""
    if MATRICES not in self.sizes:
      return buffers
    out = dict(buffers)
    m = buffers[MATRICES]
    slots = m.reshape(*m.shape[:-1], self.matrix_slots, self._block_sizes[MATRICES])
    tree = {}
    for leaf in self._block:
      if leaf.group == MATRICES:
        cut = slots[..., leaf.offset : leaf.offset + leaf.size]
        _set(tree, leaf.path, cut.reshape(*slots.shape[:-1], *leaf.shape))
    out[MATRICES] = tree
    return out

  def unview(self, viewed) -> dict:
    """The inverse of :meth:`view`."""
    if MATRICES not in self.sizes:
      return viewed
    out = dict(viewed)
    parts = []
    for leaf in self._block:
      if leaf.group == MATRICES:
        x = _get(viewed[MATRICES], leaf.path)
        parts.append(x.reshape(*x.shape[: -len(leaf.shape)], leaf.size))
    m = jnp.concatenate(parts, axis=-1)
    out[MATRICES] = m.reshape(*m.shape[:-2], -1)
    return out

  def view_mask(self, mask) -> dict:
    """A per-leaf mask of the model's parameters (``model.decay_mask``, ``model.muon_mask``) on
    :meth:`view`'s structure: each matrix leaf its own value, each other buffer the value its
    leaves share (a mask that splits a buffer is an error)."""
    out = {}
    block = mask[model.BLOCKS]["0"]
    shared = model.shared(mask)
    for g in self.sizes:
      if g == MATRICES:
        out[g] = {}
        for leaf in self._block:
          if leaf.group == g:
            _set(out[g], leaf.path, bool(_get(block, leaf.path)))
        continue
      values = {bool(_get(block, x.path)) for x in self._block if x.group == g}
      values |= {bool(_get(shared, x.path)) for x in self._shared if x.group == g}
      if len(values) > 1:
        raise ValueError(f"the mask splits the {g!r} buffer: its leaves take both values")
      out[g] = values.pop() if values else False
    return out


def on_view(tx, packing: StagePacking) -> optax.GradientTransformationExtraArgs:
  """``tx`` run on :meth:`StagePacking.view` of the buffers: its state is in the view's structure,
  its updates come back as buffers (extra arguments, such as a global norm, pass through)."""

  def init(params):
    return tx.init(packing.view(params))

  def update(updates, state, params=None, **extra):
    params = None if params is None else packing.view(params)
    updates, state = optax.with_extra_args_support(tx).update(
      packing.view(updates), state, params, **extra
    )
    return packing.unview(updates), state

  return optax.GradientTransformationExtraArgs(init, update)


def stage_counts(
  cfg: model.ModelConfig, num_stages: int, spec: str, equal: bool
) -> tuple[int, ...]:
  """The run's blocks per stage: ``spec`` if given, else equal stages when ``equal`` (and they
  divide the blocks), else :func:`balanced_counts`."""
  counts = parse_counts(spec, cfg.N, num_stages)
  if counts is not None:
    return counts
  if equal and cfg.N % num_stages == 0:
    return equal_counts(cfg.N, num_stages)
  return balanced_counts(cfg, num_stages)
